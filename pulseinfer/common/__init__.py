"""The ground floor: helpers every process uses (flags, process setup, gRPC, peers, the API key, model metadata). Imports no service."""

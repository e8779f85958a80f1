"""The bounds every process applies alike: what a request may ask for, what the wire can carry, and the
defaults a request or a step takes when its sender names none."""

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs limit (vLLM's default max_logprobs)
UINT32_MAX = 2**32 - 1  # max_tokens, top_k and token ids travel as proto uint32
FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p travel as proto float

DEFAULT_MAX_TOKENS = 256  # a request that leaves max_tokens out (the gateway also caps it by the context)
PREFILL_CHUNK = 512  # prefill tokens per step (the scheduler's --prefill-chunk; a worker's plan sizes activations by it)

"""Model metadata without torch: the config (config.py), the GGUF reader (gguf_file.py), the tokenizer and
chat template (tokenizer.py), and a model's config and tokenizer read from its path (meta.py). The gateway
and the kv_store read a model here; gpu_worker/model/loader.py adds the weights."""

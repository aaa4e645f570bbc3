"""The fabric under a Hugging Face transformers model: the engine, its Ray actor, layer-wise cache and KV codec."""

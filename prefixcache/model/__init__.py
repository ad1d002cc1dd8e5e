"""prefixcache.model: a plain-PyTorch Llama-family decoder and everything to load it.

- `config.ModelArchConfig`: validated architecture (from config.json or GGUF metadata).
- `llama.LlamaForCausalLM`: the decoder; `attention.PagedAttention` is the only part that
  knows about KV pages, driven by `attention_metadata.AttentionMetadata`.
- `loader.load_model(path | None, dtype) -> LoadedModel(model, arch_config, tokenizer, path)`:
  a Hugging Face folder, a .gguf file, or the default SmolLM2 (`default_model`).
- `tokenizer.Tokenizer`, `chat_template.render_chat_template`,
  `detokenizer.IncrementalDetokenizer`.
"""

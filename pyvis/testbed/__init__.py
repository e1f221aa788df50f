"""The real-weights MoE testbed (docs/testbed.md).

    moefy           build a MoE GGUF from a dense model (SmolLM2) with real weights
    corpus          calibration and held-out text
    collect         routing of a model on text through llama.cpp's eval callback
    routing_report  `pyvis report`: skew, co-activation, reuse, recall, LRU vs Belady
    quality         `pyvis quality`: perplexity and KL divergence through llama-perplexity
    train_moe       `pyvis testbed train`: a small Qwen3-MoE trained on CPU (torch, optional) -> models/trained/
    train_model     its torch model (torch is imported only when training runs); train_export: its GGUF
    gate_stats      `pyvis testbed gates`: gate-weight medians per rank, decode turnover of routing traces
    _llm            low-level llama.cpp access shared by these tools (eval callback, kv overrides)
"""

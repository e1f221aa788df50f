"""The real-weights MoE testbed (docs/testbed.md).

    moefy           build a MoE GGUF from a dense model (SmolLM2) with real weights
    corpus          calibration and held-out text
    collect         routing of a model on text through llama.cpp's eval callback
    routing_report  `pyvis report`: skew, co-activation, reuse, recall, LRU vs Belady
    quality         `pyvis quality`: perplexity and KL divergence through llama-perplexity
    _llm            low-level llama.cpp access shared by these tools (eval callback, kv overrides)
"""

"""Every route vLLM 0.32's OpenAI-compatible server has (``vllm serve``, a generative model), by
method and path: read from its source (``vllm/entrypoints/**/api_router.py``, ``serve/instrumentator``,
``serve/dev``, ``rl``, ``sagemaker``, ``scale_out``) in the pinned CPU build. The pod's guard must
answer 401 or 404 to a stranger on each, and 404 to anyone on each the router never uses."""

ROUTER_USES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
               ("GET", "/health"), ("GET", "/metrics")]

NEVER_USED = [
    ("POST", "/invocations"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("GET", "/load"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"), ("POST", "/pause"), ("POST", "/resume"),
    ("GET", "/is_paused"), ("POST", "/abort_requests"), ("POST", "/update_weights"), ("GET", "/get_world_size"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/abc"), ("POST", "/v1/messages"), ("POST", "/v1/embeddings"),
    ("POST", "/pooling"), ("POST", "/classify"), ("POST", "/score"), ("POST", "/rerank"), ("POST", "/v1/rerank"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("GET", "/server_info"),
    ("POST", "/collective_rpc"), ("POST", "/start_profile"), ("POST", "/stop_profile"), ("GET", "/docs"),
    ("GET", "/openapi.json"), ("POST", "/inference/v1/generate"), ("POST", "/v1/audio/transcriptions"),
    ("GET", "/kv_event_sources"), ("GET", "/"), ("GET", "/health/"), ("GET", "/v1/models/x"),
]

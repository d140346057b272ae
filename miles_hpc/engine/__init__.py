"""The embedded inference engine behind SGLang's HTTP API (stage: engine; docs/engine.md).

`server` (the HTTP routes, auth), `core` (the engine thread: scheduler, runner, control calls), `scheduler`,
`kv_cache` and `paged_attention` (continuous batching over a paged KV cache with prefix caching), `runner`,
`decode_forward`, `cuda_graphs` and the Triton kernels (the model step), `sampling`, `weights`,
`weight_receiver`, `delta_receiver`, `direct_weights` and `lora` (weight updates as SGLang joins them), `launch`
(the one typed value of every ``miles-hpc serve`` flag). Nothing outside imports the engine but the CLI and
`launch` (its command line): clients reach it over HTTP and process groups, as they reach SGLang.
"""

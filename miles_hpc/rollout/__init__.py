"""The client side of rollout (stage: rollout): everything that talks to engines, SGLang or ours.

`client` (the SGLang HTTP API, typed `requests` and `responses`), `router` (least-in-flight with prefix affinity,
fail-over), `sglang` (SGLang's launch flags and the rendezvous records engines announce themselves with),
`placement`, `conversation` and `agents` (multi-turn agents, TITO), `rewards`, `filters`, `distill` (teacher
scores), `plugins` (dotted-path plug-ins) and `contract` (their contract checks). Never imports `train`.
"""

"""One module per weight-sync strategy (`broadcast`, `p2p`, `delta`, `colocated` + `colocated_direct`, `lora`) and
what they share (`base`). `sync.factory` maps `sync.strategy` to them; nothing outside `sync/` names one."""

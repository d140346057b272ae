"""The BF16 delta codec (`delta_codec`, its bit coder `bitcodes`, GPU kernels `delta_kernels`) and the on-disk
version format (`delta_manifest`), shared by the trainer (encode) and the engine (decode). Imports only `sync.wire`."""

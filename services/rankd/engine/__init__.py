"""rankd's ``torch`` execution backend: a Qwen3-architecture decoder with zigzag
context-parallel prefill over a cached prefix (cp-attention.md rules 1-11), a paged per-rank
prefix KV cache, in-place CP group switching (split/merge) and the decode role.

Modules are named after what they are: ``config`` (HF Qwen3 config), ``model`` (decoder and
single-process reference forward), ``checkpoint`` (HF-format directory IO), ``zigzag`` (the
partition), ``attention`` (masked / varlen attention kernels), ``groups`` (lattice process
groups), ``cp_prefill`` (the CP forward), ``kvcache`` (prefix cache), ``decode`` (decode role
and KV transport), ``device`` (the ``VTM_TORCH_DEVICE`` check, the decode role's device).
Chained block hashes, shared with the gateway, are ``shared.blockhash``.
"""

"""Deep dive 3b, FSDP in practice: a model too big for one rank built on `meta` and initialised shard by shard,
`dcp.async_save` while training goes on, clipping and accumulation under FSDP2, what to wrap, resharding after
forward (to groups, too), mixed precision, activation checkpointing. Its checks are in the notebook; its code here
is its quiz."""

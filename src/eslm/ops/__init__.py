"""The lowest layer: the LM-head backends (``head_backend``: the protocol and the registry), the fused backend's
route rule (``head_route``), and the data types the layers above share (``token_stats``)."""

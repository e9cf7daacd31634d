"""The storage format: quantizers and bit packing, rotation, 8-bit parameters, the full part, a layer's store,
per-layer code widths."""

"""The NCCL path: projection, QK norm + RoPE, one all_to_all_single, unpack."""

"""The drop-ins' refusal of attentions with unmerged LoRA adapters (PEFT): they copy the
base weights, so such an adapter would be lost without a word."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("diffusers")

from cake_sp.integrations import check_adapters_merged  # noqa: E402


def _flux_block_with_lora():
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    torch.manual_seed(0)
    block = FluxTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32)
    config = peft.LoraConfig(r=2, target_modules=["to_q", "add_k_proj"],
                             init_lora_weights=False)
    return peft.inject_adapter_in_model(config, block)


def test_unmerged_adapters_are_named():
    block = _flux_block_with_lora()
    with pytest.raises(ValueError, match="not merged") as info:
        check_adapters_merged([("blocks.0.attn", block.attn)])
    assert "'blocks.0.attn.to_q', 'blocks.0.attn.add_k_proj'" in str(info.value)
    assert "fuse_lora()" in str(info.value)


def test_merged_or_disabled_adapters_and_plain_modules_pass():
    block = _flux_block_with_lora()
    lora_layers = [m for m in block.attn.modules() if hasattr(m, "merged_adapters")]
    assert len(lora_layers) == 2
    for layer in lora_layers:
        layer.enable_adapters(False)
    check_adapters_merged([("attn", block.attn)])
    for layer in lora_layers:
        layer.enable_adapters(True)
        layer.merge()  # the delta now in the base weight, which the drop-in copies
    check_adapters_merged([("attn", block.attn)])
    check_adapters_merged([("", torch.nn.Linear(4, 4))])


def test_kept_submodules_may_carry_unmerged_adapters():
    """A submodule the drop-in keeps and calls as it is (FLUX.2's single-stream ``to_out``)
    keeps its adapters: named in ``kept`` (full names), it is not refused; the others are."""
    block = _flux_block_with_lora()
    check_adapters_merged([("b.attn", block.attn)], kept={"b.attn.to_q", "b.attn.add_k_proj"})
    with pytest.raises(ValueError, match="not merged") as info:
        check_adapters_merged([("b.attn", block.attn)], kept={"b.attn.to_q"})
    assert "'b.attn.add_k_proj'" in str(info.value) and "to_q" not in str(info.value)

"""Vision and diffusion networks train with parity (issue #25 item 3): Hugging Face ResNet
(BatchNorm), ConvNeXt, ViT and Swin image classifiers and a ``diffusers`` ``UNet2DModel``
(GroupNorm, timestep embedding, skip concatenations, attention blocks), each built from a
small config, under ``dp`` and ``zero3`` on ``{"dp": 4}`` and ``auto`` and ``megatron`` on
``{"dp": 2, "tp": 2}``, on 4 gloo ranks: 2 AdamW steps whose losses equal one process's, then
``prog.verify`` clean (every node's value and gradient, every parameter gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fxpar

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(400)]

MESHES = {"dp": {"dp": 4}, "zero3": {"dp": 4}, "auto": {"dp": 2, "tp": 2},
          "megatron": {"dp": 2, "tp": 2}}


def _build(name: str):
    """``(model, args, kwargs, loss_fn, targets)`` of the small model ``name``, in train mode."""
    import transformers as tf

    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 5, (8,))
    if name == "resnet":
        m = tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5))
    elif name == "convnext":
        m = tf.ConvNextForImageClassification(tf.ConvNextConfig(
            num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, patch_size=4))
    elif name == "vit":
        m = tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    elif name == "swin":
        m = tf.SwinForImageClassification(tf.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
            window_size=4, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, drop_path_rate=0.0))
    else:   # diffusion: predict the noise added at a timestep
        from diffusers import UNet2DModel

        m = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=4, attention_head_dim=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
        noise = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        return (m.train(), (torch.randn(8, 3, 16, 16), torch.arange(8) * 100), {},
                lambda out, n: torch.nn.functional.mse_loss(out.sample, n), (noise,))
    return m.train(), (x,), {"labels": y}, None, ()


def _train(name: str, plan: str):
    m, args, kw, loss_fn, targets = _build(name)
    ref = copy.deepcopy(m)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), args, kw, plan=plan,
                         mesh=MESHES[plan], loss_fn=loss_fn, example_targets=targets,
                         optimizer=opt, time_limit=10)
    runner, ref_opt = prog.runner(), opt(ref.parameters())
    losses = []
    for _ in range(2):
        got = float(runner.step(*args, *targets, **kw))
        out = ref(*args, **kw)
        loss = loss_fn(out, *targets) if loss_fn else out.loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((got, float(loss)))
    rep = prog.verify(*args, *targets, **kw)
    return losses, rep.ok, str(rep)


@pytest.mark.parametrize("name,plan", [(n, p) for n in ("resnet", "convnext", "vit", "swin", "unet")
                                       for p in ("dp", "zero3", "auto", "megatron") if
                                       not (n == "resnet" and p == "megatron")])
def test_vision_model_trains_with_parity(pools, name, plan):
    if name == "unet":
        pytest.importorskip("diffusers")
    for losses, ok, text in pools(4).run(_train, name, plan):
        for got, want in losses:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), losses
        assert losses[1][1] != losses[0][1]   # it trains
        assert ok, text

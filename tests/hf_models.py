"""Every causal-LM architecture of the installed ``transformers``, built tiny from its own
config class (issue #32): used by ``tests/test_hf_sweep.py`` (a fixed sample of 20
architectures) and ``benchmarks/hf_sweep.py`` (all of them, ``./dev bench hf-sweep``).

The architectures are :data:`transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`
(:func:`model_types`). :func:`tiny_config` starts from the config class's defaults and sets,
wherever the config has the attribute (and recursively in its sub-configs: a multimodal model's
``text_config`` and ``vision_config``, DBRX's ``ffn_config``...):

* 2 layers, hidden 64, 4 attention heads (2 key/value heads; all 4 under MLA), head dim 16,
  intermediate 128 (64 per expert), vocab 128, at most 64 positions;
* 8 experts, top-k at most 2, the MoE layers starting at layer 1 (``first_k_dense_replace``...),
  one expert group; MLA dims small and consistent (``kv_lora_rank`` 32, ``q_lora_rank`` 48,
  ``qk_rope_head_dim`` 8, ``qk_nope_head_dim`` 16, ``v_head_dim`` 16);
* every ``*dropout*`` / ``*pdrop*`` probability 0, router jitter 0, ``use_cache=False``;
* per-layer lists (``layer_types``...) cut to 2 entries, keeping both kinds of a hybrid
  (one layer of each of the first two kinds);
* special token ids outside the vocab moved to its top (inputs are drawn below it);

then :data:`FIXUPS` per architecture where that is not enough. A multimodal config whose
causal-LM class takes the text config alone (Llama 4, Qwen3.5, Emu3...) gives that text config.
:func:`build` makes the model (float32, seeded, train mode) and one batch ``(4, 16)`` of token
ids with ``labels`` (the model computes its own loss; :data:`INPUTS` and :data:`AFTER_BUILD`
where an architecture needs more); :func:`eager_check` runs one forward + backward in this process
(an architecture whose eager step fails at this size is reported ``eager-fails`` and left out
of the counts, as the issue did).

:func:`worker` is the :class:`fxpar.testing.WorkerPool` task: on every rank, build, capture
(``fxpar.capture``), compile the captured graph with ``plan`` on ``mesh`` over
``Cluster.local(4)`` (:func:`cluster`; ``time_limit`` 20 s), train ``steps`` AdamW steps and
compare each step's loss, and then every parameter (this rank's shard), with the same model
trained in one process (a deep copy made before compiling). Each call runs under an alarm
and process-group time-outs of ``case_timeout``; ranks that ended it at different points or
with different errors say so, and :func:`run_arch`, which drives it and merges the ranks'
records into one :class:`Result`, then starts the pool afresh before the next call.
"""

from __future__ import annotations

import copy
import math
import re
import signal
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["CLASSES", "FIXUPS", "MESHES", "PLANS", "SAMPLE", "Result", "build", "eager_check",
           "eager_result", "model_types", "run_arch", "summarize", "tiny_config", "to_json",
           "worker"]

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, POSITIONS = 2, 64, 4, 2, 16, 128, 128, 64
EXPERTS, TOP_K = 8, 2
BATCH, SEQ = 4, 16
#: token ids of the inputs are drawn from [0, VOCAB - RESERVED): special ids moved to the top
RESERVED = 16
#: plan -> mesh, as the issue runs them (4 gloo ranks)
#: sweep plan -> mesh; ``auto-tp4`` is ``plan="auto"`` on ``{"tp": 4}`` (issue #32 item 2)
MESHES = {"auto": {"dp": 2, "tp": 2}, "dp": {"dp": 4}, "megatron": {"dp": 2, "tp": 2},
          "zero3": {"dp": 4}, "auto-tp4": {"tp": 4}}
#: what the sweep runs unless told (``--plans``)
PLANS = ("auto", "dp", "megatron")
WORLD = 4
#: outcome classes, in the order reports list them
CLASSES = ("parity", "wrong", "error", "eager-fails")
#: loss tolerance (per step), and the parameters' after the last step (AdamW at lr 1e-2: a
#: wrong gradient moves a parameter by ~1e-2)
RTOL, ATOL = 1e-4, 1e-4
PARAM_TOL = 1e-3

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
               "num_decoder_layers", "num_blocks")
#: the suite's deterministic sample (tests/test_hf_sweep.py; ``--sample`` of the sweep), sorted:
#: Llama, GPT-2, Mixtral, Qwen2, Gemma; the MLA family (DeepSeek-V2/V3, MiniCPM3); and, among
#: the architectures at parity in the first full sweep, fast ones of every kind: encoder-style
#: decoder (bert-generation), ALiBi (bloom), multi-query (gpt_bigcode), parallel residual
#: (gpt_neox, gptj), soft-capping (gemma2), MoE (granitemoe, olmoe, qwen2_moe with a shared
#: expert), state space (mamba2), and some whose auto plan shards parameters at this size
#: (cohere, gemma, gemma2, mamba2, nemotron)
SAMPLE = ("bert-generation", "bloom", "cohere", "deepseek_v2", "deepseek_v3", "gemma", "gemma2",
          "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granitemoe", "llama", "mamba2", "minicpm3",
          "mixtral", "nemotron", "olmoe", "qwen2", "qwen2_moe")

_SET = {  # attribute -> value, wherever the config has it
    **dict.fromkeys(_LAYER_KEYS, LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embedding_dim", "emb_dim",
                     "hidden_size_global"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads",
                     "decoder_attention_heads", "num_decoder_attention_heads",
                     "attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "num_query_groups"),
                    KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_head", "dim_head", "kv_channels",
                     "attention_head_dim"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "d_inner",
                     "dim_ff", "feed_forward_size", "ffn_hidden_size", "dff"), INTER),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size",
                     "shared_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "expert_ffn_hidden_size",
                     "dense_intermediate_size", "prefix_dense_intermediate_size",
                     "intermediate_size_mlp"), INTER // 2),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts"),
                    EXPERTS),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index",
                     "first_k_dense"), 1),
    **dict.fromkeys(("router_jitter_noise", "input_jitter_noise"), 0.0),
    # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...)
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "use_cache": False,
}
#: set even where the default is None (derived or unset, not "off")
_SET_IF_NONE = {"head_dim", "num_key_value_heads", "n_inner", "num_local_experts",
                "n_routed_experts", "num_experts", "moe_num_experts"}
_TOP_K = ("num_experts_per_tok", "top_k", "moe_k", "num_experts_per_token", "moe_topk",
          "top_k_experts")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
              "max_target_positions", "context_length")
#: per-layer lists cut to LAYERS entries
_PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types",
              "attention_types", "attn_layers")
#: never touched (identity, bookkeeping)
_SKIP = {"transformers_version", "architectures", "model_type", "_name_or_path", "id2label",
         "label2id", "dtype"}

#: per-architecture fix-ups: ``model_type -> {attribute: value}`` applied on top of the
#: generic settings (to the top-level config; ``"text_config.x"`` reaches into a sub-config)
FIXUPS: dict[str, dict[str, Any]] = {
    "blt": {"encoder_hash_byte_group_vocab": 512},  # 500002 hash embeddings by default
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}},
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.kv_n_heads": KV_HEADS,
             "attn_config.clip_qkv": 8.0},  # clip_qkv=None (the default) fails in clamp
    "dots1": {"n_shared_experts": 1},
    # sliding-window layers: head_dim = qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": {"vision_config.adapter_in_dim": HIDDEN, "vision_config.adapter_out_dim": HIDDEN,
                   "audio_config.adapter_input_size": HIDDEN, "audio_config.adapter_out_dim": HIDDEN,
                   "text_config.head_dim": 24},
    "dots3_note_text": {"head_dim": 24},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"head_dim": 2 * HIDDEN // HEADS, "n_groups": 1},  # heads * head_dim = 2 * hidden
    "musicgen": {"decoder.num_codebooks": 1},
    "musicgen_melody": {"decoder.num_codebooks": 1},
    "qwen4_exp_text": {"indexer_n_heads": HEADS, "indexer_kv_heads": 1,
                       "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    # LSH and local attention in chunks of 8, axial position embeddings over 4 x 4 positions
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 2,
                 "max_position_embeddings": 16},
    # the shared transformer block is tied across the hybrid layers: it needs two of them
    "zamba": {"num_hidden_layers": 3,
              "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
}
# Gemma 3n: the last layers reuse the keys/values of earlier layers of the same kind, so the
# two kinds (sliding, full) each need a producer before the consumers: 4 layers, 2 shared
_GEMMA3N = {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "intermediate_size": [INTER] * 4, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]}
FIXUPS["gemma3n_text"] = _GEMMA3N
FIXUPS["gemma3n"] = {"text_config." + k: v for k, v in _GEMMA3N.items()}
FIXUPS["qwen4_exp"] = {"text_config." + k: v for k, v in FIXUPS["qwen4_exp_text"].items()}

#: per-architecture inputs beyond ``input_ids`` and ``labels``: ``model_type -> fn(ids) ->
#: kwargs`` (replacing ``{"labels": ids}``)
INPUTS: dict[str, Any] = {
    # one codebook: ids (batch * codebooks, seq), labels (batch, seq, codebooks)
    "musicgen": lambda ids: {"labels": ids.unsqueeze(-1)},
    "musicgen_melody": lambda ids: {"labels": ids.unsqueeze(-1)},
}
#: per-architecture steps after the model is built: ``model_type -> fn(model)``
AFTER_BUILD: dict[str, Any] = {
    "xmod": lambda m: m.set_default_language("en_XX"),
}


def model_types() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _pick_layers(lst: list) -> list:
    """2 entries of a per-layer list: the first two distinct kinds (a hybrid keeps both)."""
    kinds = list(dict.fromkeys(map(str, lst)))
    by_kind = {str(v): v for v in lst}
    picks = [by_kind[k] for k in kinds[:LAYERS]]
    return (picks * LAYERS)[:LAYERS]


def _tiny_kwargs(d: dict) -> dict:
    """The generic settings for a config whose (non-recursive) ``to_dict()`` is ``d``."""
    kw: dict[str, Any] = {}
    n_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    for k, v in d.items():
        if k == "per_layer_config" and isinstance(v, dict) and v and n_layers is not None:
            # heterogeneous layers (layer index -> overrides): the first override on layer 1
            k0 = min(v, key=int)
            over = v[k0] if isinstance(v[k0], dict) else {}
            kw[k] = {str(LAYERS - 1).zfill(len(k0)): {**over, **_tiny_kwargs(over)}}
        if k in _SKIP or isinstance(v, dict):
            continue
        if k in _SET and (v is not None or k in _SET_IF_NONE) and not isinstance(v, (list, bool)):
            kw[k] = _SET[k]
        elif k in _SET and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            kw[k] = [_SET[k]] * LAYERS  # per-layer sizes (Gemma 3n's intermediate_size)
        elif k in _TOP_K and (isinstance(v, int) or v is None):
            kw[k] = TOP_K if v is None else min(v, TOP_K)
        elif k == "rotary_dim" and isinstance(v, int):
            kw[k] = HEAD_DIM // 2
        elif k in _POSITIONS and isinstance(v, int):
            kw[k] = POSITIONS
        elif isinstance(v, list) and v and (k in _PER_LAYER or (
                n_layers is not None and n_layers > LAYERS and len(v) == n_layers)):
            kw[k] = _pick_layers(v)  # a per-layer list (by name, or by its length)
        elif isinstance(v, float) and ("dropout" in k or "pdrop" in k or k == "layerdrop"
                                       or k.endswith("_layerdrop")):
            kw[k] = 0.0
        elif k == "use_cache":
            kw[k] = False
    if "kv_lora_rank" in d:  # MLA: every head has its own keys and values
        if "num_key_value_heads" in kw:
            kw["num_key_value_heads"] = HEADS
        if "head_dim" in kw and "qk_rope_head_dim" in d:  # head_dim is the rope part
            kw["head_dim"] = _SET["qk_rope_head_dim"]
    if "qk_head_dim" in d and "qk_nope_head_dim" in d:
        kw["qk_head_dim"] = _SET["qk_nope_head_dim"] + _SET["qk_rope_head_dim"]
    # special token ids: inside the vocab (the inputs are drawn below VOCAB - RESERVED)
    top = VOCAB - 1
    for k, v in sorted(d.items()):
        if k.endswith(("_id", "_token_index")) and k not in kw:
            if isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB - RESERVED:
                kw[k] = top
                top -= 1
            elif isinstance(v, list) and v and all(isinstance(x, int) for x in v) \
                    and max(v) >= VOCAB - RESERVED:
                kw[k] = [VOCAB - 1 - i for i in range(len(v))]
    return kw


def _shrink(cfg, extra: dict | None = None, top: bool = True):
    """``cfg`` with the generic settings (recursively) and ``extra``: a new config of its class
    at the top, a dict (what a parent config builds its sub-config from) below."""
    extra = dict(extra or {})
    d = cfg.to_dict()
    kw = _tiny_kwargs(d)
    for name in (getattr(cfg, "sub_configs", None) or {}):
        sub = getattr(cfg, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        sub_extra = {k.split(".", 1)[1]: v for k, v in extra.items() if k.startswith(name + ".")}
        kw[name] = _shrink(sub, sub_extra, top=False)
    kw.update({k: v for k, v in extra.items() if "." not in k})
    if top:
        return type(cfg)(**kw)
    base = {k: v for k, v in d.items() if k not in _SKIP or k == "model_type"}
    return {**base, **kw}


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (module docstring): of the class its causal-LM model
    takes (a multimodal config's text config where the model is the text model alone)."""
    from transformers import AutoConfig

    cfg = _shrink(AutoConfig.for_model(model_type), FIXUPS.get(model_type))
    want = getattr(model_class(model_type), "config_class", None)
    if want is not None and not isinstance(cfg, want):
        subs = [getattr(cfg, n, None) for n in (getattr(cfg, "sub_configs", None) or {})]
        cfg = next((s for s in subs if isinstance(s, want)), cfg)
    cfg.use_cache = False
    return cfg


def model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, seed: int = 0):
    """``(model, input_ids, kwargs)``: the tiny model (float32, train mode, initialized from
    ``seed``) and one ``(BATCH, SEQ)`` batch, ``kwargs = {"labels": input_ids}``; the same on
    every call and every rank."""
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    model = model_class(model_type)(cfg).float()
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB - RESERVED, (BATCH, SEQ), generator=g)
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    kwargs = INPUTS[model_type](ids.clone()) if model_type in INPUTS else {"labels": ids.clone()}
    return model, ids, kwargs


def _loss(model, ids, kwargs):
    out = model(input_ids=ids, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out[0]
    return loss


def eager_check(model_type: str, seed: int = 0) -> str:
    """'' when one forward + backward of the tiny model works in this process and gives a
    finite loss and some gradient, else why not (one line)."""
    try:
        model, ids, kwargs = build(model_type, seed)
        loss = _loss(model, ids, kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return f"no scalar loss ({type(loss).__name__})"
        if not torch.isfinite(loss):
            return f"loss is {loss.item()}"
        loss.backward()
        if not any(p.grad is not None for p in model.parameters()):
            return "no parameter gets a gradient"
    except Exception as e:  # noqa: BLE001 - every failure is a result
        return _first_line(e)
    return ""


def _first_line(e: BaseException) -> str:
    """``Type: message`` on one line (a message that ends its first line with ':' keeps the
    next one: a config validator's reason)."""
    msg = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
    head = " ".join(msg[:2]) if len(msg) > 1 and msg[0].endswith(":") else (msg[0] if msg else "")
    return f"{type(e).__name__}: {head}"[:300]


# -- one architecture under one plan, on every rank -------------------------------------------
@dataclass
class Result:
    """One architecture under one plan, merged over the ranks (:func:`run_arch`)."""

    arch: str
    plan: str
    outcome: str                  # one of CLASSES
    error: str = ""               # first line of the error, or the mismatch
    phase: str = ""               # where it stopped: build, capture, plan, runner, train, compare
    capture_s: float | None = None
    plan_s: float | None = None   # fxpar.compile on the captured graph (planning + emit)
    solve_s: float | None = None  # of which the solver
    train_s: float | None = None  # runner creation + the steps
    sharded: bool | None = None   # some parameter is stored sharded (not replicated)
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    max_loss_diff: float | None = None
    wall_s: float = 0.0           # driver, the whole call


class _Timeout(Exception):
    pass


_PHASES = ("build", "capture", "plan", "runner", "train", "compare", "done")


def cluster(kind: str, world: int = WORLD):
    """``"local"``: ``Cluster.local(world)``, as the parity tests; ``"free"``: the same with
    nearly free communication (:func:`tests.opinfo_ops.free_comm_cluster`: the planner then
    shards wherever it saves any compute)."""
    import fxpar
    from tests.opinfo_ops import free_comm_cluster

    if kind == "local":
        return fxpar.Cluster.local(world)
    if kind == "free":
        return free_comm_cluster(world)
    raise ValueError(f"cluster {kind!r}: 'local' or 'free'")


def _train(model_type: str, plan: str, mesh: dict, steps: int, time_limit: float,
           rec: dict, cluster_kind: str) -> None:
    """Fill ``rec`` (this rank's record) for one architecture under ``plan``."""
    import torch.distributed as dist

    import fxpar
    from fxpar.runtime.redistribute import distribute

    rec["phase"] = "build"
    model, ids, kwargs = build(model_type)
    ref = copy.deepcopy(model)
    rec["phase"] = "capture"
    t0 = time.perf_counter()
    gm = fxpar.capture(model, (ids,), kwargs)
    rec["capture_s"] = time.perf_counter() - t0
    rec["phase"] = "plan"
    # every rank has captured before the clock starts: plan_s is planning (rank 0 solves, the
    # others wait for its plan without a core), not rank 0 sharing the cores with captures
    dist.barrier()
    # eps 1e-5 as tests/test_runtime_parity.py: gradients that are rounding noise in theory
    # (a key bias) must not become steps of ~lr
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)
    t0 = time.perf_counter()
    prog = fxpar.compile(model, cluster(cluster_kind, dist.get_world_size()), (ids,), kwargs,
                         plan=plan.split("-")[0], mesh=mesh, optimizer=opt, time_limit=time_limit,
                         graph=gm)
    rec["plan_s"] = time.perf_counter() - t0
    rec["solve_s"] = prog.plan.stats.get("solve_s")
    rec["phase"] = "runner"
    t0 = time.perf_counter()
    runner = prog.runner()
    rec["sharded"] = any(not sp.is_replicated for sp in runner.specs.values())
    rec["phase"] = "train"
    ropt = opt(ref.parameters())
    for _ in range(steps):
        loss = runner.forward_backward(ids, **kwargs)
        runner.optimizer_step()
        rl = _loss(ref, ids, kwargs)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        rec["losses"].append(float(loss))
        rec["ref_losses"].append(float(rl.detach()))
    rec["train_s"] = time.perf_counter() - t0
    rec["phase"] = "compare"
    rec["outcome"], rec["error"] = "parity", ""
    diffs = [abs(a - b) for a, b in zip(rec["losses"], rec["ref_losses"])]
    rec["max_loss_diff"] = max(diffs) if all(map(math.isfinite, diffs)) else float("nan")
    for k, (a, b) in enumerate(zip(rec["losses"], rec["ref_losses"])):
        if not math.isfinite(a) and math.isfinite(b):
            rec["outcome"], rec["error"] = "wrong", f"step {k}: loss {a} (one process: {b:.6g})"
            return
        if not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL):
            rec["outcome"], rec["error"] = "wrong", f"step {k}: loss {a:.6g}, one process {b:.6g}"
            return
    # the parameters after the last step: this rank's shard of the one-process parameter
    ref_state = dict(ref.named_parameters())
    shape, coord = runner.mesh.shape, runner.coord
    for fqn, t in runner.state.items():
        if fqn in ref_state:
            want = distribute(ref_state[fqn].detach(), runner.specs[fqn], shape, coord)
            if t.shape != want.shape or not torch.allclose(t.detach(), want, rtol=PARAM_TOL,
                                                           atol=PARAM_TOL):
                err = (float((t.detach() - want).abs().max()) if t.shape == want.shape
                       else f"shape {tuple(t.shape)} vs {tuple(want.shape)}")
                rec["outcome"] = "wrong"
                rec["error"] = f"parameter {fqn} after {steps} steps: max difference {err}"
                return
    rec["phase"] = "done"


def worker(model_type: str, plan: str, mesh: dict | None = None, steps: int = 2,
           time_limit: float = 20.0, case_timeout: float = 300.0,
           cluster_kind: str = "local") -> dict:
    """One architecture under ``plan`` on this rank (a :class:`fxpar.testing.WorkerPool` task):
    returns this rank's record and ``stopped`` (the process group may be out of step: a
    time-out, or ranks that ended at different points or with different errors)."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.opinfo_ops import _restore_timeouts, _set_timeouts, _sync_group

    mesh = dict(mesh or MESHES[plan])
    rec: dict[str, Any] = {"phase": "build", "outcome": "error", "error": "", "losses": [],
                           "ref_losses": []}
    sync = _sync_group()
    saved = _set_timeouts(timedelta(seconds=case_timeout))

    def alarm(signum, frame):
        raise _Timeout(f"took longer than {case_timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, case_timeout)
    try:
        _train(model_type, plan, mesh, steps, time_limit, rec, cluster_kind)
    except BaseException as e:  # noqa: BLE001 - every failure is a result
        rec["outcome"], rec["error"] = "error", _first_line(e)
        if isinstance(e, _Timeout):
            rec["error"] = f"timeout in {rec['phase']}: {e}"
        rec["trace"] = traceback.format_exc()[-3000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    doubt = isinstance(rec.get("error"), str) and rec["error"].startswith("timeout")
    mine = torch.tensor([_PHASES.index(rec["phase"]), zlib.crc32(rec["error"].encode()),
                         int(doubt)], dtype=torch.int64)
    try:
        signal.setitimer(signal.ITIMER_REAL, 60.0)
        got = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(got, mine, group=sync)
        doubt = doubt or any(not torch.equal(g[:2], mine[:2]) or int(g[2]) for g in got)
    except BaseException:  # noqa: BLE001
        doubt = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        _restore_timeouts(saved)
    return {"record": rec, "stopped": doubt}


_SEVERITY = {"parity": 0, "wrong": 1, "error": 2}


def _merge(arch: str, plan: str, recs: list[dict]) -> Result:
    r0 = recs[0]
    worst = max(recs, key=lambda r: _SEVERITY[r["outcome"]])
    res = Result(arch, plan, worst["outcome"], worst["error"], worst["phase"],
                 *(None if r0.get(k) is None else round(r0[k], 3)
                   for k in ("capture_s", "plan_s", "solve_s", "train_s")),
                 r0.get("sharded"), r0["losses"], r0["ref_losses"],
                 None if r0.get("max_loss_diff") is None else float(f"{r0['max_loss_diff']:.3g}"))
    if len({(r["outcome"], r["error"]) for r in recs}) > 1:
        by = "; ".join(f"rank {i}: {r['outcome']}" + (f" ({r['error']})" if r["error"] else "")
                       for i, r in enumerate(recs))
        res.outcome = "error" if any(r["outcome"] == "error" for r in recs) else "wrong"
        res.error = f"ranks disagree: {by}"[:400]
    elif any(r["losses"] != r0["losses"] for r in recs):
        res.outcome, res.error = "wrong", "ranks report different losses: " + \
            "; ".join(f"rank {i}: {r['losses']}" for i, r in enumerate(recs))[:300]
    if res.outcome == "error":
        tr = next((r.get("trace") for r in recs if r.get("trace")), None)
        if tr:
            res.__dict__["trace"] = tr
    return res


def _pool_error(text: str) -> str:
    """One line for a failed pool call: its first line, and what ended it (a rank's death,
    or the last exception line of a rank's traceback)."""
    msg = [l.strip() for l in text.strip().splitlines() if l.strip()]
    first = msg[0] if msg else ""
    died = next((l for l in msg if re.match(r"rank \d+'s process", l)), "")
    if died:
        return f"{first} {died.split(';')[0]}"
    exc = next((l for l in reversed(msg) if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", l)), "")
    return first if exc in ("", first) else f"{first} ... {exc}"


def run_arch(pool, arch: str, plan: str, *, steps: int = 2, time_limit: float = 20.0,
             timeout: float = 300.0, mesh: dict | None = None,
             cluster_kind: str = "local") -> Result:
    """``arch`` under ``plan`` on ``pool`` (a :class:`fxpar.testing.WorkerPool` of
    :data:`WORLD` ranks; the eager check is the caller's). A rank that dies or hangs past
    ``timeout`` is an ``error``; the pool is torn down then (it restarts on its next call),
    and after a call that may have left the ranks out of step."""
    from fxpar.errors import FxparError

    t0 = time.monotonic()
    try:
        outs = pool.run(worker, arch, plan, mesh, steps, time_limit, timeout, cluster_kind,
                        timeout=timeout + 90)
    except FxparError as e:  # WorkerError, CollectiveTimeoutError: the pool was torn down
        pool.close(force=True)
        res = Result(arch, plan, "error", f"{type(e).__name__}: {_pool_error(str(e))}"[:400],
                     "unknown")
        res.__dict__["trace"] = str(e)[-3000:]
        res.wall_s = round(time.monotonic() - t0, 1)
        return res
    if any(o["stopped"] for o in outs):
        pool.close(force=True)  # a fresh process group before the next call
    res = _merge(arch, plan, [o["record"] for o in outs])
    res.wall_s = round(time.monotonic() - t0, 1)
    return res


def eager_result(arch: str, plan: str, why: str) -> Result:
    return Result(arch, plan, "eager-fails", why, "eager")


def summarize(results: list[Result]) -> dict:
    """Counts per plan and class (``eager-fails`` apart: not in ``total``)."""
    out: dict[str, Any] = {}
    for p in dict.fromkeys(r.plan for r in results):
        rs = [r for r in results if r.plan == p]
        counts = {c: sum(1 for r in rs if r.outcome == c) for c in CLASSES}
        ran = [r for r in rs if r.outcome != "eager-fails"]
        plan_s = sorted(r.plan_s for r in ran if r.plan_s is not None)
        out[p] = {"counts": counts, "total": len(ran),
                  "parity_pct": round(100.0 * counts["parity"] / max(1, len(ran)), 1),
                  "sharded": sum(1 for r in ran if r.sharded),
                  "plan_s_median": plan_s[len(plan_s) // 2] if plan_s else None,
                  "plan_s_max": plan_s[-1] if plan_s else None,
                  "failing": {r.arch: f"{r.outcome}: {r.error}" for r in ran
                              if r.outcome != "parity"}}
    return out


def to_json(results: list[Result]) -> list[dict]:
    return [{**asdict(r), **({"trace": r.__dict__["trace"]} if "trace" in r.__dict__ else {})}
            for r in results]

"""The scales notebooks 05 and 08 run at (the paper's, the CPU's, a smoke test), and the
rule that picks one for a device and a model size.
"""

from __future__ import annotations

from ..core.papers import SFT_LR_GRID, ZHANG_HEAD_COUNTS, ZHANG_MLP_COUNTS, ZHANG_SFT
from ..yu.lora import reference_layer, yu_bands

#: Sizes of notebooks 05 (LoRA) and 08 (precise and full SFT) at three scales. "paper": Yu Sec. 5 (18,000 / 2,000 sentences,
#: lr grid per layer, up to 4 epochs) and Zhang Sec. 5.3 (lr 2e-5, batch 128, 2 epochs,
#: warm-up 0.02, weight decay 0.1; 8-64 heads, 1-6 MLPs) - for a GPU. "cpu" (what "auto"
#: gives on a CPU; the scale the report judges there): every layer; ``n_test`` = 385 =
#: ``stats.n_for_half_width(0.5, 0.05)``, a 95 % half-width of 5 points, the smallest
#: threshold of the 05/06 rules (:data:`JUDGED_HALF_WIDTH`); ``n_train`` = 512 for one
#: epoch: the smallest size of the measured learning curve of one layer at which the LoRA
#: model's validation accuracy interval lies above the original's, on the model that
#: gains least (``scripts/lora_learning_curve.py``: SmolLM2-135M, layer 8 of 30, 0.5 % ->
#: 7.3 % [4.0, 11.9]; benchmarks/RESULTS.md; notebook 05's "Scale" section);
#: the lr grid searched on 192 validation sentences at Yu's reference layer; SFT's lr
#: chosen per method (precise, full) from :data:`SFT_LR_GRID` on the same validation
#: sentences, since one epoch of ~35 steps is not Zhang's ~300 (a fixed 1e-4 made full
#: SFT diverge, a fixed 2e-5 may barely move the heads); 24 CNA cases. "quick": layer 0
#: and one layer per Yu band, a few steps, one precise-SFT setting - a smoke test of
#: every section (minutes), never judged.
#: The 95 % half-width (5 points) the "cpu" scale's test split is sized for: the smallest
#: threshold of the 05/06 rules (papers.NOISE_GAP, papers.ZHANG_PRECISE_MARGIN).
JUDGED_HALF_WIDTH = 0.05


#: "cpu-bands": the "cpu" scale's data sizes, lr search and test split, with LoRA on layer 0,
#: Yu's reference layer and the centre layer of each band (as "quick") instead of every
#: layer, and precise SFT of the (scaled) top-32 heads only (Zhang's Table 1 setting), no
#: MLP variants. "auto" picks it on a CPU for models above this many parameters, where the
#: "cpu" scale's 30 LoRA trainings would take longer than two hours for a judged CPU run
#: (Qwen2.5-Coder-1.5B: benchmarks/RESULTS.md).
CPU_FULL_SCALE_MAX_PARAMS = 1_000_000_000


FINETUNE_SCALES: dict[str, dict] = {
    "paper": dict(
        n_train=18_000,
        n_val=1_000,
        n_test=2_000,
        layers="all",
        lr_search="per_layer",
        lora_epochs=4,
        lora_batch=16,
        cna_cases=None,
        n_candidates=200,
        word_train=300,
        word_test=132,
        sft_lrs=(ZHANG_SFT["lr"],),
        sft_batch=128,
        sft_epochs=2,
        sft_warmup=0.02,
        sft_weight_decay=0.1,
        head_counts=ZHANG_HEAD_COUNTS,
        mlp_counts=ZHANG_MLP_COUNTS,
        prose_chunks=32,
        sft_train_seeds=3,
    ),
    "cpu": dict(
        n_train=512,
        n_val=192,
        n_test=385,
        layers="all",
        lr_search="reference",
        lora_epochs=1,
        lora_batch=16,
        cna_cases=24,
        n_candidates=100,
        word_train=48,
        word_test=48,
        sft_lrs=SFT_LR_GRID,
        sft_batch=16,
        sft_epochs=1,
        sft_warmup=0.0,
        sft_weight_decay=0.1,
        head_counts=ZHANG_HEAD_COUNTS,
        mlp_counts=(1, 3),
        prose_chunks=4,
        sft_train_seeds=3,
    ),
    "quick": dict(
        n_train=48,
        n_val=0,
        n_test=48,
        layers="bands",
        lr_search="none",
        lora_epochs=1,
        lora_batch=16,
        cna_cases=6,
        n_candidates=50,
        word_train=16,
        word_test=24,
        sft_lrs=(1e-4,),
        sft_batch=16,
        sft_epochs=1,
        sft_warmup=0.0,
        sft_weight_decay=0.1,
        head_counts=(32,),
        mlp_counts=(),
        prose_chunks=2,
        sft_train_seeds=2,
    ),
}


# the cpu scale on fewer layers and SFT settings: what "auto" picks on a CPU above
# CPU_FULL_SCALE_MAX_PARAMS (a smaller stated scale for the 1.5B model)
FINETUNE_SCALES["cpu-bands"] = dict(
    FINETUNE_SCALES["cpu"], layers="bands", head_counts=(32,), mlp_counts=(), sft_train_seeds=1
)


def resolve_scale(scale: str, device: str, quick: bool, auto_cpu: str = "cpu", n_params: int | None = None) -> str:
    """The scale a run uses: "quick" when ``quick``; for "auto", "paper" on a GPU and
    ``auto_cpu`` on a CPU ("cpu", the judged CPU scale; older runs resolved it
    to "quick", which the report passes for their tables), "cpu-bands" instead of "cpu"
    for a model of more than :data:`CPU_FULL_SCALE_MAX_PARAMS` parameters (``n_params``);
    else ``scale`` as given."""
    if quick:
        return "quick"
    if scale == "auto":
        if str(device).startswith("cuda"):
            return "paper"
        if auto_cpu == "cpu" and n_params is not None and n_params > CPU_FULL_SCALE_MAX_PARAMS:
            return "cpu-bands"
        return auto_cpu
    return scale


def scale_settings(scale: str, device: str, quick: bool, n_layers: int, n_params: int | None = None) -> dict:
    """The settings of ``scale`` ("auto": :func:`resolve_scale`; ``quick`` forces
    "quick"), with ``layers`` resolved to a list for a model of ``n_layers``
    ("bands": layer 0, Yu's reference layer and the centre layer of each other band
    of :func:`yu_bands`; every layer when there are at most 4)."""
    scale = resolve_scale(scale, device, quick, n_params=n_params)
    if scale not in FINETUNE_SCALES:
        raise ValueError(f"scale must be 'auto' or one of {sorted(FINETUNE_SCALES)}, got {scale!r}")
    s = dict(FINETUNE_SCALES[scale], scale=scale)
    if s["layers"] == "all":
        s["layers"] = list(range(n_layers))
    elif s["layers"] == "bands":
        if n_layers <= 4:
            s["layers"] = list(range(n_layers))
        else:
            ref = reference_layer(n_layers)
            centres = {b[len(b) // 2] for b in yu_bands(n_layers).values() if ref not in b}
            s["layers"] = sorted({0, ref} | centres)
    return s

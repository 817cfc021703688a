"""`build_profile(bf16, quantized, fn)`: what must be kept to re-quantize updated BF16 weights
the way a given 8-bit checkpoint was made, and how well that explains the checkpoint.

Streams: both checkpoints are read tensor by tensor, one smoothing group (at most the linears
fed by one norm) at a time; nothing holds a whole model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashrl_tools import __version__
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import sha256_file
from flashrl_tools.model_structure import model_layout, read_config
from flashrl_tools.profile.format import ModelRef, Profile, ProfileMeta
from flashrl_tools.profile.groups import layer_groups
from flashrl_tools.profile.recover import Member, Stats, fit_factors, score
from flashrl_tools.quant.quant_config import QUANT_EXTRA_SUFFIXES, ignored_by, layer_formats
from flashrl_tools.quant.quantize import parse_fn
from flashrl_tools.quant.quantizer import QuantFn, smooth_norm
from flashrl_tools.safetensors_io import CheckpointReader

# A fit must beat "no smoothing" by this much to be kept (otherwise it only fits noise, e.g.
# GPTQ rounding decisions on an unsmoothed group).
_MIN_GAIN = 0.01


@dataclass(frozen=True)
class ReportRow:
    tensor: str
    kind: str  # "linear" | "norm"
    smoothed: bool
    entries: int
    exact_fraction: float
    max_abs_diff: int
    clip_fraction: float


@dataclass
class ProfileResult:
    profile: Profile
    rows: list[ReportRow]  # worst first
    seconds: float

    def summary(self) -> dict:
        lin = [r for r in self.rows if r.kind == "linear"]
        entries = sum(r.entries for r in lin)
        return {
            "fn": self.profile.meta.fn,
            "quantized_linears": len(self.profile.meta.quantized),
            "smoothed_groups": len(self.profile.meta.smoothing_groups),
            "smoothing_factors_all_one": self.profile.smoothing_is_identity,
            "int8_entries": entries,
            "exact_fraction": (sum(r.exact_fraction * r.entries for r in lin) / entries) if entries else None,
            "worst_layer_exact_fraction": min((r.exact_fraction for r in lin), default=None),
            "max_abs_diff": max((r.max_abs_diff for r in lin), default=None),
            "clip_fraction": (sum(r.clip_fraction * r.entries for r in lin) / entries) if entries else None,
            "seconds": round(self.seconds, 2),
        }

    def report(self) -> dict:
        return {"summary": self.summary(), "layers": [asdict(r) for r in self.rows]}


def checkpoint_format(quantized_dir: Path) -> QuantFn:
    """Which of our formats a compressed-tensors checkpoint is in (from its config.json)."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = read_config(quantized_dir).get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        raise FlashRLError("not a compressed-tensors 8-bit checkpoint (config.json has no "
                           "compressed-tensors quantization_config)", str(quantized_dir),
                           "pass the quantized model with -qm")
    try:
        cfg = QuantizationConfig.model_validate(qc)
        groups = list(cfg.config_groups.values())
        # a mixed checkpoint (quant_config.py): the `Linear` group, beside groups naming their modules
        (scheme,) = groups if len(groups) == 1 else [g for g in groups if "Linear" in g.targets]
    except (ValueError, TypeError) as e:
        raise FlashRLError(f"unsupported quantization_config ({str(e).splitlines()[0]})",
                           str(quantized_dir), "one scheme group of W8A8 INT8 or FP8 is supported") from None
    w = scheme.weights
    fn = QuantFn.from_scheme(w.type, w.num_bits, w.strategy)
    if fn is None:
        kind = (getattr(w.type, "value", w.type), w.num_bits, getattr(w.strategy, "value", w.strategy))
        raise FlashRLError(f"unsupported weight quantization {kind}", str(quantized_dir),
                           "supported: int8 per channel, fp8 per channel/tensor/block")
    return fn


def model_ref(model_dir: Path, hash_files: bool = True) -> ModelRef:
    reader = CheckpointReader(model_dir)
    return ModelRef(path=str(Path(model_dir).resolve()),
                    model_type=read_config(model_dir).get("model_type", "?"),
                    files={f.name: sha256_file(f) if hash_files else "" for f in reader.files})


def check_pair(bf16: CheckpointReader, q: CheckpointReader, linears: set[str]) -> None:
    """Same architecture and shapes; raise naming the first offending tensor."""
    for name in sorted(bf16.names()):
        if name not in q:
            if name.startswith("lm_head."):
                continue
            raise FlashRLError(f"tensor {name} is missing from the quantized checkpoint", str(q.dir),
                               "profile a BF16 model against an 8-bit checkpoint of the same model")
        if bf16.shape(name) != q.shape(name):
            raise FlashRLError(f"tensor {name} has shape {list(bf16.shape(name))} in the BF16 model but "
                               f"{list(q.shape(name))} in the quantized one", str(q.dir),
                               "the two checkpoints are different models")
        if name in linears and f"{name}_scale" not in q:
            raise FlashRLError(f"tensor {name} is not quantized in the quantized checkpoint "
                               f"(no {name}_scale)", str(q.dir), "pass an 8-bit checkpoint")
    for name in sorted(q.names()):
        if name not in bf16 and not name.endswith(QUANT_EXTRA_SUFFIXES) and not name.startswith("lm_head."):
            raise FlashRLError(f"tensor {name} of the quantized checkpoint is not in the BF16 model",
                               str(bf16.dir), "the two checkpoints are different models")


def build_profile(bf16_dir: Path, quantized_dir: Path, fn: QuantFn | str,
                  hash_files: bool = True) -> ProfileResult:
    t0 = time.perf_counter()
    fn = parse_fn(fn)
    found = checkpoint_format(quantized_dir)
    four = any(f.packed for f in layer_formats(read_config(quantized_dir).get("quantization_config")).values())
    if found.packed or four:
        raise FlashRLError(f"{'mixed 4/8-bit' if four else found.value} checkpoints have no profile yet (a 4-bit "
                           "sync re-quantizes from BF16 with the quantizer alone: FLASHRL_CONFIG=w4a16 or "
                           "w4a16_layers)", str(quantized_dir), "profile an 8-bit checkpoint")
    if found is not fn:
        raise FlashRLError(f"the quantized checkpoint is {found.value}, not --fn {fn.value}",
                           str(quantized_dir), f"pass --fn {found.value}")
    b_type = read_config(bf16_dir).get("model_type")
    q_type = read_config(quantized_dir).get("model_type")
    if b_type != q_type:
        raise FlashRLError(f"different architectures: BF16 model is {b_type}, quantized is {q_type}",
                           str(quantized_dir), "profile two checkpoints of the same model")
    layout = model_layout(bf16_dir)
    bf16, q = CheckpointReader(bf16_dir), CheckpointReader(quantized_dir)
    # linears the 8-bit checkpoint keeps in high precision (its `ignore`: mixed precision) stay BF16
    ignore = read_config(quantized_dir).get("quantization_config", {}).get("ignore", [])
    linears = {n for n in layout.linear_weights if n in bf16 and not ignored_by(n.removesuffix(".weight"), ignore)}
    check_pair(bf16, q, linears)
    quantized = sorted(n for n in linears if f"{n}_scale" in q)
    meta = dict(fn=fn.value, flashrl_tools=__version__,
                bf16_model=model_ref(bf16_dir, hash_files), quantized_model=model_ref(quantized_dir, hash_files),
                quantized=quantized)
    if not fn.calibratable:  # FP8 / 4-bit: which tensors, in which format; nothing is calibrated
        return ProfileResult(Profile(ProfileMeta(**meta)), [], time.perf_counter() - t0)

    tensors: dict[str, torch.Tensor] = {}
    rows: list[ReportRow] = []
    groups_meta: list[dict] = []
    row_div: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for groups in layer_groups(set(quantized), set(bf16.names())).values():
        for g in groups:
            members = [Member(bf16.get(n), q.get(n), q.get(f"{n}_scale"), row_div.get(n)) for n in g.members]
            norm = None if g.smooth_is_linear else (bf16.get(g.smooth), q.get(g.smooth))
            factors, stats = _fit_group(members, norm)
            if factors is not None:
                groups_meta.append({"smooth": g.smooth, "members": list(g.members)})
                for n in g.members:
                    tensors[f"{n.removesuffix('.weight')}.smooth_in"] = factors
                if g.smooth_is_linear:
                    row_div[g.smooth] = factors
                    tensors[f"{g.smooth.removesuffix('.weight')}.smooth_out"] = factors
                else:
                    tensors[f"{g.smooth.removesuffix('.weight')}.smooth"] = factors
            if norm is not None:
                rows.append(_norm_row(g.smooth, norm, factors))
                done.add(g.smooth)
            for n, m, st in zip(g.members, members, stats):
                tensors[f"{n}_scale"] = m.scale
                rows.append(_linear_row(n, st, factors is not None or n in row_div))
                done.add(n)
            del members, norm  # free this group's weights before reading the next group's
    for n in quantized:  # linears outside any smoothing group (o_proj, ...)
        if n not in done:
            m = Member(bf16.get(n), q.get(n), q.get(f"{n}_scale"), row_div.get(n))
            tensors[f"{n}_scale"] = m.scale
            rows.append(_linear_row(n, score(m, None), n in row_div))
    for n in bf16.names():  # other norms must be untouched
        if bf16.dtype(n).is_floating_point and len(bf16.shape(n)) == 1 and n.endswith("norm.weight") \
                and n not in done and n in q:
            rows.append(_norm_row(n, (bf16.get(n), q.get(n)), None))
    rows.sort(key=lambda r: (r.exact_fraction, -r.max_abs_diff, -r.clip_fraction, r.tensor))
    profile = Profile(ProfileMeta(**meta, smoothing_groups=groups_meta), tensors)
    return ProfileResult(profile, rows, time.perf_counter() - t0)


def _fit_group(members: list[Member], norm) -> tuple[torch.Tensor | None, list[Stats]]:
    """The group's smoothing factors (None: no smoothing) and each member's reproduction stats."""
    plain = None
    if norm is None or torch.equal(norm[0], norm[1]):
        plain = [score(m, None) for m in members]
        if norm is not None or all(st.exact_fraction == 1.0 for st in plain):
            return None, plain  # an unchanged norm, or exact without smoothing
    factors = fit_factors(members, norm)
    fitted = [score(m, factors) for m in members]
    if plain is not None and _total(fitted) <= _total(plain) + _MIN_GAIN:
        return None, plain
    return factors, fitted


def _total(stats: list[Stats]) -> float:
    return sum(stats, Stats(0, 0, 0, 0)).exact_fraction


def _linear_row(name: str, st: Stats, smoothed: bool) -> ReportRow:
    return ReportRow(name, "linear", smoothed, st.entries, st.exact_fraction, st.max_abs_diff, st.clip_fraction)


def _norm_row(name: str, norm: tuple[torch.Tensor, torch.Tensor], factors) -> ReportRow:
    nb, nq = norm
    pred = smooth_norm(nb, factors)
    same = (pred == nq)
    diff = (pred.float() - nq.float()).abs().max().item() if nb.numel() else 0.0
    return ReportRow(name, "norm", factors is not None, nb.numel(), same.float().mean().item(),
                     int(diff > 0), 0.0)

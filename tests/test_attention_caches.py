"""Every cache of the attention backends is keyed by everything its value depends on.

The caches: the decode-step tables shared by the layers of one step (:class:`StepTables`, DCA and
Self-Extend), Self-Extend's grouped rotation tables (``_GROUPED_TABLES``), STRING's shift factors and DCA's
chunk-step angles (per layer, shared by ``dataclasses.replace`` copies), the dynamic RoPE frequencies of
:class:`ScaledRotaryEmbedding`. Each test fills a cache, changes one thing the cached value depends on
(a size, the rotary layout, the score scaling, the frequencies, the position ids edited in place) and
compares with the same call on empty caches; a key missing a field returns the stale value.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import dual_chunk, self_extend, self_extend_kernels
from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit, dual_chunk_fused
from hf_posext.backends.attention.self_extend import SelfExtendLayerSettings, grouped_attention, self_extend_decode
from hf_posext.backends.attention.shifted_positions import StringLayerSettings, string_explicit, string_split
from hf_posext.models import tiny_model
from tests.conftest import logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

LENGTH, HEAD_DIM = 97, 8


def _inv_freq(base: float = 10000.0, rotary_dim: int = HEAD_DIM) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))


def _qkv(seed: int = 0):
    torch.manual_seed(seed)
    return (torch.randn(2, 4, LENGTH, HEAD_DIM), torch.randn(2, 2, LENGTH, HEAD_DIM), torch.randn(2, 2, LENGTH, HEAD_DIM))


def _fresh(run, clear) -> torch.Tensor:
    clear()
    return run()


def _assert_same_as_fresh(run, clear, *, differs_from: torch.Tensor | None = None) -> None:
    """``run()`` with whatever the caches hold equals ``run()`` on empty caches (and, when given, differs
    from ``differs_from``: the change being tested changes the output, so a stale value is seen)."""
    cached = run()
    fresh = _fresh(run, clear)
    torch.testing.assert_close(cached, fresh, atol=1e-6, rtol=1e-6)
    if differs_from is not None:
        assert (fresh - differs_from).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------------
# Decode-step tables (StepTables): DCA and Self-Extend
# --------------------------------------------------------------------------------------------------

DCA_LAYER = DualChunkLayerSettings(_inv_freq(), HEAD_DIM, False, 24, 4, "sdpa")
DCA_VARIANTS = {
    "chunk_size": dict(chunk_size=30),
    "local_window": dict(local_window=6),
    "rotary_dim": dict(rotary_dim=4, inv_freq=_inv_freq(rotary_dim=4)),
    "interleaved": dict(interleaved=True),
    "scale_length": dict(scale_length=32),
}
SELF_EXTEND_LAYER = SelfExtendLayerSettings(_inv_freq(), HEAD_DIM, False, 3, 7, "sdpa")
SELF_EXTEND_VARIANTS = {
    "group_size": dict(group_size=4),
    "neighbor_window": dict(neighbor_window=11),
    "rotary_dim": dict(rotary_dim=4, inv_freq=_inv_freq(rotary_dim=4)),
    "interleaved": dict(interleaved=True),
}
DECODE = {
    "dca": (dual_chunk_decode, DCA_LAYER, DCA_VARIANTS, dual_chunk.clear_decode_tables),
    "self-extend": (self_extend_decode, SELF_EXTEND_LAYER, SELF_EXTEND_VARIANTS, self_extend.clear_decode_tables),
}


def _variant(layer, changes: dict):
    changes = dict(changes)
    if "inv_freq" not in changes:
        return dataclasses.replace(layer, **changes)
    # new frequencies come with a new settings object (a re-patch), never a copy sharing per-layer caches
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer) if f.init and not f.name.startswith("_")
              and f.name != "grouped_keys"}
    return type(layer)(**{**fields, **changes})


@pytest.mark.parametrize("method", sorted(DECODE))
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_tables_follow_every_setting_of_the_layer(method, rows):
    decode, layer, variants, clear = DECODE[method]
    q, k, v = _qkv()
    query = q[:, :, -rows:]
    positions = torch.arange(LENGTH - rows, LENGTH)[None]  # one tensor for every call, as a model's layers get
    clear()
    base = decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)
    for name, changes in variants.items():
        other = _variant(layer, changes)
        _assert_same_as_fresh(lambda: decode(query, k, v, None, positions, other, HEAD_DIM ** -0.5), clear, differs_from=base)
        decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)  # the base tables again, held


@pytest.mark.parametrize("method", sorted(DECODE))
def test_decode_tables_follow_the_scaling_the_frequencies_and_the_key_count(method):
    decode, layer, _, clear = DECODE[method]
    q, k, v = _qkv()
    query, positions = q[:, :, -1:], torch.tensor([[LENGTH - 1]])
    clear()
    base = decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)
    _assert_same_as_fresh(lambda: decode(query, k, v, None, positions, layer, 0.5), clear, differs_from=base)
    other_frequencies = _variant(layer, {"inv_freq": _inv_freq(base=500.0)})
    decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)
    _assert_same_as_fresh(lambda: decode(query, k, v, None, positions, other_frequencies, HEAD_DIM ** -0.5), clear,
                          differs_from=base)
    decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)
    fewer = 60  # the same last position, fewer cached keys (a cropped cache): keys LENGTH - 60 .. LENGTH - 1
    _assert_same_as_fresh(lambda: decode(query, k[:, :, -fewer:], v[:, :, -fewer:], None, positions, layer, HEAD_DIM ** -0.5),
                          clear)


@pytest.mark.parametrize("method", sorted(DECODE))
def test_decode_tables_follow_position_ids_edited_in_place(method):
    decode, layer, _, clear = DECODE[method]
    q, k, v = _qkv()
    query, positions = q[:, :, -2:], torch.arange(LENGTH - 2, LENGTH)[None]
    clear()
    base = decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5)
    positions.add_(7)  # the same tensor, other positions: keys now at 7 .. 103 (not a whole number of chunks)
    _assert_same_as_fresh(lambda: decode(query, k, v, None, positions, layer, HEAD_DIM ** -0.5), clear, differs_from=base)


# --------------------------------------------------------------------------------------------------
# Self-Extend's grouped rotation tables, STRING's shift factors, DCA's chunk-step angles
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [dict(group_size=4), dict(neighbor_window=11), dict(inv_freq=_inv_freq(base=500.0)),
                                     dict(inv_freq=_inv_freq(base=10000.0, rotary_dim=4), rotary_dim=4)],
                         ids=["group_size", "neighbor_window", "frequencies", "rotary_dim"])
def test_grouped_tables_follow_sizes_and_frequencies(changes):
    q, k, v = _qkv()
    positions = torch.arange(LENGTH)[None]
    settings = dict(inv_freq=_inv_freq(), rotary_dim=HEAD_DIM, interleaved=False, group_size=3, neighbor_window=7)

    def run(**changed):
        s = {**settings, **changed}
        return grouped_attention(q, k, v, None, positions, positions, s["inv_freq"], s["rotary_dim"], s["interleaved"],
                                 s["group_size"], s["neighbor_window"], HEAD_DIM ** -0.5)

    self_extend_kernels._GROUPED_TABLES.clear()
    base = run()
    _assert_same_as_fresh(lambda: run(**changes), self_extend_kernels._GROUPED_TABLES.clear, differs_from=base)


def test_grouped_tables_keep_the_query_and_key_roles_apart():
    """Queries and keys get different tables (queries shifted by W - W // G): a key table served for
    queries would drop that shift."""
    from tests.test_self_extend import _reference, _rope

    raw_q, raw_k, v = _qkv()
    positions = torch.arange(LENGTH)[None]
    q, k = _rope(raw_q, positions, _inv_freq()).float(), _rope(raw_k, positions, _inv_freq()).float()
    expected = _reference(raw_q, raw_k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 3, 7, _inv_freq())
    self_extend_kernels._GROUPED_TABLES.clear()
    run = lambda: grouped_attention(q, k, v, None, positions, positions, _inv_freq(), HEAD_DIM, False, 3, 7, HEAD_DIM ** -0.5)
    first = run()
    torch.testing.assert_close(first.double(), expected, atol=1e-5, rtol=1e-5)  # both tables built from empty
    _assert_same_as_fresh(run, self_extend_kernels._GROUPED_TABLES.clear)
    # only the key table held: the query table must be built, not taken from it
    self_extend_kernels._GROUPED_TABLES.clear()
    self_extend_kernels._grouped_table("key", LENGTH, 3, 7, _inv_freq(), torch.device("cpu"))
    torch.testing.assert_close(run(), first, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("changes", [dict(shifted_offset=30), dict(local_value=3)], ids=["shifted_offset", "local_value"])
@pytest.mark.parametrize("kernel", ["explicit", "split"])
def test_string_shift_factors_follow_the_sizes(kernel, changes):
    q, k, v = _qkv()
    positions = torch.arange(LENGTH)[None]
    layer = StringLayerSettings(_inv_freq(), HEAD_DIM, False, 24, 6, 1.0, "sdpa")

    def run(settings):
        if kernel == "explicit":
            return string_explicit(q, k, v, None, positions, positions, settings, HEAD_DIM ** -0.5)
        return string_split(q, k, v, None, 0, settings, HEAD_DIM ** -0.5)

    base = run(layer)  # fills layer._factors, which a dataclasses.replace copy shares
    other = dataclasses.replace(layer, **changes)
    cached = run(other)
    fresh = run(StringLayerSettings(_inv_freq(), HEAD_DIM, False, other.shifted_offset, other.local_value, 1.0, "sdpa"))
    torch.testing.assert_close(cached, fresh, atol=1e-6, rtol=1e-6)
    assert (fresh - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("changes", [dict(chunk_size=30), dict(local_window=6)], ids=["chunk_size", "local_window"])
@pytest.mark.parametrize("kernel", ["explicit", "fused"])
def test_dca_chunk_step_follows_the_sizes(kernel, changes):
    q, k, v = _qkv()
    positions = torch.arange(LENGTH)[None]
    layer = DualChunkLayerSettings(_inv_freq(), HEAD_DIM, False, 24, 4, "sdpa")

    def run(settings):
        if kernel == "explicit":
            return dual_chunk_explicit(q, k, v, None, positions, positions, settings, HEAD_DIM ** -0.5)
        return dual_chunk_fused(q, k, v, None, 0, settings, HEAD_DIM ** -0.5)

    base = run(layer)  # fills layer._frequencies, which a dataclasses.replace copy shares
    other = dataclasses.replace(layer, **changes)
    cached = run(other)
    fresh = run(DualChunkLayerSettings(_inv_freq(), HEAD_DIM, False, other.chunk_size, other.local_window, "sdpa"))
    torch.testing.assert_close(cached, fresh, atol=1e-6, rtol=1e-6)
    assert (fresh - base).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------------
# Whole models: re-patch with other parameters = a fresh patch; position ids edited in place
# --------------------------------------------------------------------------------------------------

REPATCH = [
    ("string", dict(shifted_offset=24, local_value=6), dict(shifted_offset=30, local_value=4)),
    ("dca", dict(factor=4, chunk_size=24, local_window=4), dict(factor=4, chunk_size=30, local_window=6)),
    ("dca", dict(factor=4, chunk_size=24, local_window=4), dict(factor=4, chunk_size=24, local_window=4, attention_scale=True)),
    ("self-extend", dict(group_size=3, neighbor_window=10), dict(group_size=4, neighbor_window=12)),
    ("dynamic-ntk", dict(factor=2), dict(factor=4)),
    ("dynamic-yarn", dict(factor=2), dict(factor=2, beta_slow=0.1)),  # its scale follows the length, not factor
    ("yarn+string", dict(factor=2, shifted_offset=24, local_value=6), dict(factor=3, shifted_offset=24, local_value=6)),
]


def _run_with_cache(model, ids, prefix: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for position in range(prefix, ids.shape[1]):
            out = model(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
            cache, parts = out.past_key_values, parts + [out.logits]
    return torch.cat(parts, 1)


@pytest.mark.parametrize("decode_path", [False, True], ids=["cpu_paths", "decode_kernels"])
@pytest.mark.parametrize("method,first,second", REPATCH, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(REPATCH)])
def test_repatch_with_other_parameters_equals_a_fresh_patch(monkeypatch, method, first, second, decode_path):
    if decode_path:
        if method != "self-extend":
            pytest.skip("only Self-Extend has a CPU-excluded decode kernel")
        monkeypatch.setattr(self_extend, "DECODE_DEVICES", ("cpu",))
    ids = torch.randint(3, 128, (1, 110), generator=torch.Generator().manual_seed(1))
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, method, **first)
    before = _run_with_cache(model, ids, 90)  # every cache filled with the first parameters
    hf_posext.patch(model, method, **second)
    repatched = _run_with_cache(model, ids, 90)
    fresh_model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(fresh_model, method, **second)
    fresh = _run_with_cache(fresh_model, ids, 90)
    torch.testing.assert_close(repatched, fresh, atol=1e-6, rtol=1e-6)
    assert (fresh - before).abs().max().item() > 1e-4


@pytest.mark.parametrize("decode_path", [False, True], ids=["cpu_paths", "decode_kernels"])
@pytest.mark.parametrize("method,kwargs", [("dca", dict(factor=4, chunk_size=24, local_window=4, attention_scale=True)),
                                           ("self-extend", dict(group_size=3, neighbor_window=10)),
                                           ("string", dict(shifted_offset=24, local_value=6)),
                                           ("dynamic-ntk", dict(factor=2))])
def test_a_step_after_its_position_ids_are_edited_in_place_uses_the_new_positions(monkeypatch, method, kwargs, decode_path):
    if decode_path:
        if method != "self-extend":
            pytest.skip("only Self-Extend has a CPU-excluded decode kernel")
        monkeypatch.setattr(self_extend, "DECODE_DEVICES", ("cpu",))
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(2))
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, method, **kwargs)
    with torch.no_grad():
        cache = model(ids[:, :79], use_cache=True).past_key_values
        positions = torch.tensor([[79]])
        step = lambda p: model(ids[:, 79:], past_key_values=copy.deepcopy(cache), position_ids=p, use_cache=True).logits
        at_79 = step(positions)
        positions.fill_(120)  # in place: same tensor object, new version
        edited = step(positions)
        dual_chunk.clear_decode_tables(), self_extend.clear_decode_tables()
        fresh = step(torch.tensor([[120]]))
    torch.testing.assert_close(edited, fresh, atol=1e-6, rtol=1e-6)
    assert (fresh - at_79).abs().max().item() > 1e-4


@pytest.mark.parametrize("method", ["dynamic-ntk", "dynamic-yarn"])
def test_dynamic_frequencies_follow_the_length(method):
    """ScaledRotaryEmbedding keeps the frequencies of the last length per layer type: another length is
    computed afresh, and coming back to a length gives its own frequencies again."""
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, method, factor=2)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    first = logits_of(model, ids[:, :100])
    longer = logits_of(model, ids)
    again = logits_of(model, ids[:, :100])
    fresh = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(fresh, method, factor=2)
    torch.testing.assert_close(longer, logits_of(fresh, ids), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-6)
    assert (longer[:, :100] - first).abs().max().item() > 1e-4


def test_self_extend_tables_follow_every_frequency_not_only_the_ends():
    """Two scalings may differ only in their middle frequencies (YaRN's ramp under other betas): the grouped
    tables must not be shared between them."""
    import torch

    from hf_posext.backends.attention import self_extend_kernels

    self_extend_kernels._GROUPED_TABLES.clear()
    first = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    middle = first.clone()
    middle[2] = 0.2  # same size, same first, second and last entries
    cos_a, _ = self_extend_kernels._grouped_table("key", 64, 3, 7, first, "cpu")
    cos_b, _ = self_extend_kernels._grouped_table("key", 64, 3, 7, middle, "cpu")
    assert not torch.equal(cos_a[:, 2], cos_b[:, 2])
    positions = torch.arange(64, dtype=torch.float64)
    angles = (torch.div(positions, 3, rounding_mode="floor") - positions) * 0.2
    torch.testing.assert_close(cos_b[:64, 2], angles.cos().float())


# --------------------------------------------------------------------------------------------------
# The remaining key fields: the device, the head size, the layer type, and how many step tables are held
# --------------------------------------------------------------------------------------------------


def test_grouped_tables_follow_the_device():
    """A table built for one device is never handed to a call on another (the meta device stands in for an
    accelerator: a stale table would come back on the CPU)."""
    self_extend_kernels._GROUPED_TABLES.clear()
    cos, _ = self_extend_kernels._grouped_table("key", 64, 3, 7, _inv_freq(), "cpu")
    on_meta, _ = self_extend_kernels._grouped_table("key", 64, 3, 7, _inv_freq(), torch.device("meta"))
    assert cos.device.type == "cpu" and on_meta.device.type == "meta"


def test_step_tables_need_the_same_positions_tensor_and_the_same_frequencies_each():
    """Either one alone is not enough: a new step's positions (a fresh tensor, version 0 like the last one)
    with the same frequencies, or the same positions with a re-patch's new frequencies, are built again."""
    from hf_posext.backends.attention.kernels import StepTables

    tables, built = StepTables(), []

    def build():
        built.append(1)
        return len(built)

    positions, frequencies = torch.arange(5)[None], torch.ones(4)
    assert tables.get(("k",), positions, frequencies, build) == 1
    assert tables.get(("k",), torch.arange(5)[None], frequencies, build) == 2  # another step, same frequencies
    step = torch.arange(6)[None]
    assert tables.get(("k",), step, frequencies, build) == 3
    assert tables.get(("k",), step, torch.ones(4), build) == 4  # the same step after a re-patch
    assert tables.get(("k",), step, torch.ones(4), build) == 5


def test_step_tables_hold_at_most_their_size():
    """A full set is dropped before a new key is held: ``size`` keys at most (the decode tables of long
    caches are large), so the first key is built again after ``size`` others."""
    from hf_posext.backends.attention.kernels import StepTables

    tables, built = StepTables(size=2), []
    positions, frequencies = torch.arange(5)[None], torch.ones(4)

    def build():
        built.append(1)
        return len(built)

    assert [tables.get((name,), positions, frequencies, build) for name in "ab"] == [1, 2]
    assert tables.get(("a",), positions, frequencies, build) == 1  # both held
    assert tables.get(("c",), positions, frequencies, build) == 3  # a third key: the two held ones dropped
    assert tables.get(("a",), positions, frequencies, build) == 4


def test_step_tables_of_a_call_follow_the_device():
    from hf_posext.backends.attention.kernels import StepTables

    tables = StepTables()
    positions, frequencies = torch.tensor([[9]]), torch.ones(4)
    query, key = torch.zeros(1, 2, 1, HEAD_DIM), torch.zeros(1, 2, 10, HEAD_DIM)
    build = lambda query_positions, kv_len: query_positions.device.type  # noqa: E731
    assert tables.for_call(query, key, positions, 1.0, frequencies, ("s",), "test", build) == "cpu"
    meta = tables.for_call(query.to("meta"), key.to("meta"), positions, 1.0, frequencies, ("s",), "test", build)
    assert meta == "meta"


@pytest.mark.parametrize("method", sorted(DECODE))
def test_decode_tables_follow_the_head_size(method):
    """Partial rotary: the same layer settings (rotary dimension 8) on heads of 8 and of 16 channels. The
    tables carry the unrotated channels, so heads of another size need their own."""
    decode, layer, _, clear = DECODE[method]
    torch.manual_seed(1)
    wide = [torch.randn(2, n, LENGTH, 2 * HEAD_DIM) for n in (4, 2, 2)]
    positions = torch.tensor([[LENGTH - 1]])
    clear()
    decode(wide[0][:, :, -1:, :HEAD_DIM], wide[1][..., :HEAD_DIM], wide[2][..., :HEAD_DIM], None, positions, layer, 0.25)
    run = lambda: decode(wide[0][:, :, -1:], wide[1], wide[2], None, positions, layer, 0.25)  # noqa: E731
    _assert_same_as_fresh(run, clear)


def test_dynamic_frequencies_are_kept_per_layer_type_and_device():
    """Two layer types scaled by a dynamic method at one length (Gemma 3's local base 1e4 and global 1e6;
    patching scales only the global layers, so the local ones are given the same scaling here, as patching
    does for layer types named neither full nor global): each gets its own frequencies, and a call for
    another device gets them on that device."""
    model = tiny_model("gemma3")
    hf_posext.patch(model, "dynamic-ntk", factor=4)
    rotary = model.model.rotary_emb
    assert sorted(rotary.entries) == ["full_attention", "sliding_attention"]
    both = lambda module: module.entries.update(  # noqa: E731
        sliding_attention=dataclasses.replace(module.entries["sliding_attention"], scaling=module.entries["full_attention"].scaling))
    both(rotary)
    length = 4 * model.config.max_position_embeddings
    types = ["full_attention", "sliding_attention"]
    first = [rotary.frequencies(length, layer_type)[0] for layer_type in types]
    fresh = tiny_model("gemma3")
    hf_posext.patch(fresh, "dynamic-ntk", factor=4)
    both(fresh.model.rotary_emb)
    for layer_type, seen in zip(reversed(types), reversed(first)):
        torch.testing.assert_close(seen, fresh.model.rotary_emb.frequencies(length, layer_type)[0], atol=0, rtol=0)
    assert (first[0] - first[1]).abs().max().item() > 1e-3
    assert rotary.frequencies(length, types[0], device=torch.device("meta"))[0].device.type == "meta"

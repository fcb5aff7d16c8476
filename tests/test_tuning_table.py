"""The shipped attention launch-configuration table (fuse_plugin/kernels/attention_configs_sm90.json):
well-formed, and covering every key the dispatcher can ask for on sm_90. CPU only."""
import json

import pytest
import torch

from fuse_plugin.kernels import attention as attn
from fuse_plugin.kernels import attention_config as C
from fuse_plugin.kernels import tuning

SM90 = (9, 0)
H100_SMEM = 232448  # bytes of shared memory a block may use on sm_90


@pytest.fixture(scope="module")
def table():
    path = tuning.table_path(SM90)
    assert path.exists(), f"{path} is not shipped"
    t = tuning.load_table(path)
    assert t is not None, "table unreadable or of another format"
    return t


def test_format(table):
    assert table["format"] == tuning.FORMAT
    assert table["gpus"], "no GPU entry set"
    for name, gpu in table["gpus"].items():
        assert tuple(gpu["cc"]) == SM90, name
        for field in ("triton", "torch", "date", "entries"):
            assert field in gpu, (name, field)


def test_covers_every_dispatcher_key(table):
    want = set(tuning.all_keys())
    for name, gpu in table["gpus"].items():
        have = set(gpu["entries"])
        assert not want - have, f"{name}: missing {sorted(want - have)[:5]}"
        unknown = have - want - set(tuning.optional_keys())
        assert not unknown, f"{name}: unknown keys {sorted(unknown)[:5]}"


def test_entries_well_formed(table):
    for name, gpu in table["gpus"].items():
        entries = gpu["entries"]
        for key, entry in entries.items():
            cfg = tuning.entry_to_config(entry)
            assert cfg is not None, (key, entry)
            assert len(entry) in (6, 7, 8) and entry[4] in (0, 1), (key, entry)
            bm, bn, w, s, split, kernel, dq_tile = cfg
            assert (dq_tile is not None) == (len(entry) == 8), (key, entry)
            # a TMA-kernel entry only where that kernel covers the problems (else it would
            # fall back to heuristic tiles at every call); the atomic-free pair on bwd keys only
            assert tuning.kernel_covers(kernel, key), (key, entry)
            assert bm <= 128 and bn <= 128 and w in (4, 8) and 1 <= s <= 5, (key, entry)
            src = entry[5]
            assert src in ("tuned", "heuristic", "measured") or src.startswith("from:"), (key, src)
            if src.startswith("from:"):
                assert entries[src[5:]][5] in ("tuned", "measured"), f"{key} copies an untuned {src}"
            # hand-measured entries only in the optional short-sequence bucket
            assert (src == "measured") <= (key in tuning.optional_keys()), (key, src)
            p = tuning.parse_key(key)
            d = p["dbucket"]
            # Tuned entries ran on the GPU with a bf16 bias; copies and heuristics must also
            # hold an fp32 one (at run time a config that does not fit retries with fewer
            # stages, see attention._launch).
            bias_elt = {"none": 0, "bool": 1, "float": 2 if src == "tuned" else 4}[p["mask"]]
            elt = 4 if p["dtype"] == "fp32" else 2
            smem = C.smem_estimate(p["kernel"], attn.AttentionConfig(*cfg), d, d, elt,
                                       bias_elt)
            assert smem <= H100_SMEM, (key, entry, smem)


def test_tuned_entries_present(table):
    """The shipped table was produced by the tuner on a GPU (not only heuristic copies)."""
    for name, gpu in table["gpus"].items():
        tuned = [k for k, e in gpu["entries"].items() if e[5] == "tuned"]
        assert len(tuned) >= 24, f"{name}: only {len(tuned)} tuned entries"
        # the benchmark's main rows are tuned, not copied
        for kernel in ("fwd", "bwd"):
            for d in (64, 128):
                for causal in ("full", "causal"):
                    assert f"{kernel}|bf16|d{d}|{causal}|none|n4096" in tuned


def test_every_problem_maps_to_a_key(table):
    """Every head dim / length / dtype / mask the kernels accept lands on a table key."""
    entries = next(iter(table["gpus"].values()))["entries"]
    for d in range(16, 257, 8):
        for dv in (16, d, 256):
            for L in (1, 17, 1024, 1025, 4096, 5000, 16384, 100000):
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    key = tuning.make_key("fwd", tuning.DTYPE_NAMES[dtype], tuning.d_bucket(d, dv),
                                          True, "bool", tuning.seq_bucket(L, 7))
                    assert key in entries, key


def test_lookup_reads_the_table(monkeypatch, table):
    """lookup() picks the running GPU's entry set by compute capability and name (an unknown
    sm_90 name falls back to the table's first GPU); other capabilities miss."""
    name = next(iter(table["gpus"]))
    entries = table["gpus"][name]["entries"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: SM90)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some other Hopper")
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.clear_cache()
    try:
        dev = torch.device("cuda", 0)
        got = tuning.lookup("bwd", dev, torch.bfloat16, 128, 128, True, "none", 4096, 4096)
        assert got == tuning.entry_to_config(entries["bwd|bf16|d128|causal|none|n4096"])
        got = tuning.lookup("fwd", dev, torch.float16, 80, 80, False, "float", 100, 30000)
        assert got == tuning.entry_to_config(entries["fwd|fp16|d80|full|float|n16384"])
        monkeypatch.setenv(tuning.ENV, "off")
        assert tuning.lookup("fwd", dev, torch.float16, 64, 64, False, "none", 64, 64) is None
        monkeypatch.delenv(tuning.ENV)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
        tuning.clear_cache()
        assert tuning.lookup("fwd", dev, torch.float16, 64, 64, False, "none", 64, 64) is None
    finally:
        tuning.clear_cache()


def test_short_sequences_take_their_optional_entry(monkeypatch, tmp_path):
    """max(Lq, Lk) <= SHORT_SEQ reads the n256 entry when the table has one, else the n1024 one;
    longer problems never read it."""
    entries = {tuning.make_key("fwd", "bf16", 64, False, "none", n): [bm, 64, 4, 2, 0, "tuned"]
               for n, bm in ((tuning.SHORT_SEQ, 32), (1024, 128))}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "gpus": {"G": {"cc": list(SM90), "entries": entries}}}))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: SM90)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "G")
    monkeypatch.setenv(tuning.ENV, str(path))
    tuning.clear_cache()
    try:
        dev = torch.device("cuda", 0)
        block_m = lambda lq, lk, causal=False: tuning.lookup(  # noqa: E731
            "fwd", dev, torch.bfloat16, 64, 64, causal, "none", lq, lk)
        assert block_m(197, 197)[0] == 32 and block_m(1, 256)[0] == 32
        assert block_m(257, 257)[0] == 128 and block_m(16, 1000)[0] == 128
        assert block_m(197, 197, causal=True) is None  # no entry of either bucket for causal
    finally:
        tuning.clear_cache()


def test_table_file_is_line_per_entry():
    """The table is written one entry per line (reviewable diffs) and is plain JSON."""
    text = tuning.table_path(SM90).read_text()
    json.loads(text)
    n_entries = sum(len(g["entries"]) for g in json.loads(text)["gpus"].values())
    assert text.count("\n") > n_entries


def test_fill_table_keeps_tma_entries_where_the_kernels_cover_the_key():
    """The tuner's fill step copies a TMA-kernel winner to fp16 and to other length buckets of a
    no-mask key, never to a mask key (the TMA kernels take no mask: there the general kernel's
    heuristic tiles are written instead); malformed kernel markers are refused."""
    from fuse_plugin import tune

    tma_key = "fwd|bf16|d128|causal|none|n4096"
    table = tune.fill_table({tma_key: [128, 64, 4, 2, 0, "tuned", "tma"]}, H100_SMEM)
    assert table[tma_key] == [128, 64, 4, 2, 0, "tuned", "tma"]
    assert table["fwd|fp16|d128|causal|none|n4096"] == [128, 64, 4, 2, 0, f"from:{tma_key}", "tma"]
    assert table["fwd|bf16|d128|causal|none|n16384"][-1] == "tma"
    for mask in ("bool", "float"):
        entry = table[f"fwd|bf16|d128|causal|{mask}|n4096"]
        assert entry[5] == "heuristic" and len(entry) == 6, entry
    assert all(len(e) == 6 or tuning.tma_key(k) for k, e in table.items())
    assert tuning.entry_to_config([128, 64, 4, 2, 0, "tuned", "tma"])[5] == "tma"
    assert tuning.entry_to_config([128, 64, 4, 2, 0, "tuned"])[5] == "general"
    assert tuning.entry_to_config([128, 64, 4, 2, 0, "tuned", "fast"]) is None


def test_fill_table_keeps_two_kernel_entries_on_backward_keys():
    """A "two_kernel" winner (the atomic-free backward pair) is copied to the backward keys it
    can serve (fp16, other length buckets, mask keys: the pair takes any mask), never to a
    forward key."""
    from fuse_plugin import tune

    key = "bwd|bf16|d256|causal|none|n4096"
    table = tune.fill_table({key: [64, 64, 8, 2, 0, "tuned", "two_kernel"]}, H100_SMEM)
    assert table[key] == [64, 64, 8, 2, 0, "tuned", "two_kernel"]
    assert table["bwd|fp16|d256|causal|none|n4096"][-1] == "two_kernel"
    assert table["bwd|bf16|d256|causal|float|n16384"][-1] == "two_kernel"
    assert all(tuning.kernel_covers(e[6], k) for k, e in table.items() if len(e) == 7)
    assert not any(k.startswith("fwd") and len(e) == 7 and e[6] == "two_kernel"
                   for k, e in table.items())
    assert tuning.entry_to_config([64, 64, 8, 2, 0, "tuned", "two_kernel"])[5] == "two_kernel"


def test_fill_table_keeps_tma_pair_entries_where_the_pair_covers_the_key():
    """A "tma_pair" winner (the atomic-free pair with TMA tiles, and its dQ kernel's tile) is
    copied to fp16 and other length buckets of its no-mask backward key; a mask key gets what
    such an entry falls back to at run time (the general pair's deterministic tiles)."""
    from fuse_plugin import tune

    key = "bwd|bf16|d256|causal|none|n4096"
    won = [64, 64, 8, 2, 0, "tuned", "tma_pair", [128, 32, 8, 3]]
    table = tune.fill_table({key: won}, H100_SMEM)
    assert table[key] == won
    assert table["bwd|fp16|d256|causal|none|n16384"] == won[:5] + [f"from:{key}"] + won[6:]
    fallback = C.deterministic_backward_config(256, 256, torch.bfloat16)
    for mask in ("bool", "float"):  # (a float mask may be fp32: fewer stages may be fitted)
        entry = table[f"bwd|bf16|d256|causal|{mask}|n4096"]
        assert entry[:3] == list(fallback[:3]) and entry[5:] == ["heuristic", "two_kernel"]
    assert tuning.entry_to_config(won) == (64, 64, 8, 2, False, "tma_pair", (128, 32, 8, 3))
    for bad in ([64, 64, 8, 2, 0, "tuned", "tma_pair", [128, 32, 8]],
                [64, 64, 8, 2, 0, "tuned", "tma_pair", [24, 32, 8, 3]],
                [64, 64, 8, 2, 0, "tuned", "two_kernel", [128, 32, 8, 3]],
                [64, 64, 8, 2, 0, "tuned", "tma_pair", 7]):
        assert tuning.entry_to_config(bad) is None, bad
    assert tuning.kernel_covers("tma_pair", key)
    assert not tuning.kernel_covers("tma_pair", "fwd|bf16|d256|causal|none|n4096")
    assert not tuning.kernel_covers("tma_pair", "bwd|bf16|d192|causal|none|n4096")

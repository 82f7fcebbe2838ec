"""The CPU level probe every native kernel, linear choice and skip mark asks."""

from __future__ import annotations

import pytest

from worker_svc import cpu_caps, kernel_build
from worker_svc.cpu_caps import CpuCapabilities, CpuLevelError, level_of

AVX2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2"}
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (set(), "none"),
        ({"sse2", "sse4_2", "avx"}, "none"),
        (AVX2 - {"fma"}, "none"),
        (AVX2, "avx2"),
        (AVX2 | {"avx512f"}, "avx2"),  # not all of x86-64-v4
        (AVX2 | AVX512, "avx512"),
        (AVX2 | AVX512 | {"avx512_bf16"}, "avx512-bf16"),
        (AVX2 | AVX512 | {"amx_tile", "amx_bf16"}, "avx512"),  # AMX without AVX512-BF16
        (AVX2 | AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),
        ({"avx512_bf16", "amx_tile", "amx_bf16"} | AVX512, "none"),  # levels build on each other
    ],
)
def test_level_is_the_highest_whose_flags_and_all_below_are_present(flags, level):
    assert level_of(frozenset(flags)) == level


def test_the_cap_lowers_the_level_and_never_raises_it(monkeypatch):
    real = cpu_caps.probe({})
    capped = cpu_caps.probe({cpu_caps.ENV_VAR: "avx2"})
    assert capped.cpu_level == real.cpu_level
    assert capped.level == ("avx2" if real.has("avx2") else real.level)
    assert capped.capped == (real.level != capped.level)
    assert cpu_caps.probe({cpu_caps.ENV_VAR: "AMX"}).level == real.level
    assert cpu_caps.probe({cpu_caps.ENV_VAR: "none"}).level == "none"


def test_an_unknown_cap_is_refused_with_the_levels_named():
    with pytest.raises(CpuLevelError, match="avx512-bf16"):
        cpu_caps.probe({cpu_caps.ENV_VAR: "avx3"})


def test_has_counts_every_level_below():
    caps = CpuCapabilities("amx", "avx512", frozenset())
    assert [level for level in cpu_caps.LEVELS if caps.has(level)] == ["none", "avx2", "avx512"]
    assert caps.capped and "capped" in caps.describe()


def test_compiler_targets_the_usable_level():
    assert CpuCapabilities("avx512", "avx512", frozenset()).compiler_flags() == ["-march=native"]
    assert CpuCapabilities("amx", "avx2", frozenset()).compiler_flags() == ["-march=x86-64-v3"]
    assert CpuCapabilities("amx", "avx512", frozenset()).compiler_flags() == ["-march=x86-64-v4"]
    assert CpuCapabilities("none", "none", frozenset()).compiler_flags() == []


def test_a_cpu_without_avx2_gets_no_native_build_but_a_sentence(tmp_path):
    with pytest.raises(RuntimeError, match="AVX2"):
        kernel_build.native_build(tmp_path, CpuCapabilities("none", "none", frozenset()))


def test_cpuinfo_is_read_for_flags_and_model(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu\n"
    )
    flags, model = cpu_caps.read_cpuinfo(info)
    assert flags == {"fpu", "avx2", "fma"} and model == "Some CPU"
    assert cpu_caps.read_cpuinfo(tmp_path / "missing") == (frozenset(), "")

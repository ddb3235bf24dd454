"""quantreg.host: the one reader of this host's CPU facts, and its override seam."""

from __future__ import annotations

import pytest

from quantreg import host, settings

AMX_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
               "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8\n"
               "processor\t: 1\nflags\t\t: fpu\n")
AVX2_CPUINFO = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n"


def test_parse_cpuinfo_reads_the_first_cpu() -> None:
    flags, vendor, model = host.parse_cpuinfo(AMX_CPUINFO)
    assert {"amx_tile", "amx_bf16", "avx512f"} <= flags and "fpu" in flags
    assert (vendor, model) == ("GenuineIntel", "Intel(R) Xeon(R) Processor")
    assert host.parse_cpuinfo("garbage") == (frozenset(), "", "")


@pytest.mark.parametrize(("cpuinfo", "kind"), [(AMX_CPUINFO, "amx"), (AVX2_CPUINFO, "avx2"),
                                               ("flags: avx2 fma avx512f avx512bw avx512vl\n", "avx512"),
                                               ("flags: sse2\n", "other")])
def test_kind(cpuinfo: str, kind: str) -> None:
    facts = host.HostFacts(machine="x86_64", cpu_flags=host.parse_cpuinfo(cpuinfo)[0])
    assert facts.kind == kind
    assert host.HostFacts(machine="aarch64", cpu_flags=facts.cpu_flags).kind == "other"


def test_override_edits_or_replaces_the_real_flags() -> None:
    real = frozenset({"avx2", "fma", "amx_tile", "amx_bf16"})
    assert host.apply_override(real, "-amx_tile,-amx_bf16") == {"avx2", "fma"}
    assert host.apply_override(real, "+avx512f") == real | {"avx512f"}
    assert host.apply_override(real, "avx2 fma") == {"avx2", "fma"}


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_override_is_unset_not_a_host_without_flags(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``export QUANTREG_HOST_CPU_FLAGS=`` (clearing it) made doctor report a simulated host of kind
    "other" with no flags, passing over every method that needs AVX2: empty means unset, as elsewhere."""
    monkeypatch.delenv(settings.HOST_CPU_FLAGS, raising=False)
    real = host.host_facts()
    monkeypatch.setenv(settings.HOST_CPU_FLAGS, value)
    facts = host.host_facts()
    assert not facts.simulated and facts.cpu_flags == real.cpu_flags and facts.kind == real.kind


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_simulate_makes_quantreg_believe_the_other_kind(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in host.simulate(kind).items():
        monkeypatch.setenv(name, value)
    facts = host.host_facts()
    assert facts.simulated
    if facts.is_x86:
        assert facts.kind == kind
    assert facts.as_json()["simulated"] is True
    with pytest.raises(ValueError, match="unknown host kind"):
        host.simulate("gpu")


def test_real_facts_are_not_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.HOST_CPU_FLAGS, raising=False)
    facts = host.host_facts()
    assert not facts.simulated and facts.cores >= 1
    assert facts.as_json()["kind"] == facts.kind


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_the_vllm_kernel_verdict_follows_the_host_kind(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor, the demo and explain's limitation ask one function; its answer is the kind's, with the reason."""
    from quantreg import vllm_limits

    for name, value in host.simulate(kind).items():
        monkeypatch.setenv(name, value)
    verdict = vllm_limits.vllm_cpu_mxfp4_kernel()
    if not host.host_facts().is_x86:
        assert not verdict.runs and "x86-only" in verdict.reason
        return
    assert verdict.runs is (kind == "amx")
    assert verdict.host["kind"] == kind and verdict.host["simulated"] is True
    assert "simulated by QUANTREG_HOST_CPU_FLAGS" in verdict.reason
    if kind == "avx2":
        assert "has no AMX: amx_tile, amx_bf16 missing" in verdict.reason
        assert vllm_limits.cpu_mxfp4_unsupported() is not verdict.emulation
    assert verdict.as_json()["runs"] is verdict.runs


def test_the_kernel_verdict_on_a_host_that_is_not_x86() -> None:
    from quantreg import vllm_limits

    arm = host.HostFacts(machine="aarch64", cpu_flags=frozenset({"asimd"}))
    verdict = vllm_limits.vllm_cpu_mxfp4_kernel(arm)
    assert not verdict.runs and verdict.reason == "the kernel is x86-only and this host is aarch64"


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_hardware_flags_ignore_a_simulation(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a plugin's native kernel dispatches on: the real /proc/cpuinfo flags, whatever quantreg believes."""
    monkeypatch.delenv(settings.HOST_CPU_FLAGS, raising=False)
    real = host.host_facts().cpu_flags
    for name, value in host.simulate(kind).items():
        monkeypatch.setenv(name, value)
    assert host.host_facts().simulated
    assert host.hardware_cpu_flags() == real
    assert host.hardware_cpu_flags() == host.parse_cpuinfo(open(host.CPUINFO).read())[0]

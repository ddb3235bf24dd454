"""Plugins through real entry points: throwaway distributions on sys.path, group ``quantreg``.

Every distribution here is written by :class:`conftest.PluginSite`; ``importlib.metadata`` finds
it exactly like an installed package. Allow-lists keep other installed plugins out of the way.

How entry points are found (one name in two distributions, ``group_entry_points``) is in
test_plugins_entry_points.py.
"""

from __future__ import annotations

import json
import sys

import pytest
from core_support import PluginSite, plugin_failures, run_cli

import quantreg
from quantreg import Key, Registry, Tier
from quantreg.plugins import Plugins

pytestmark = pytest.mark.usefixtures("clean_env")

IMPL = """
class {cls}:
    def __init__(self, moe_config, **options):
        self.moe_config = moe_config
        self.options = options
"""


def methods_plugin(*methods: str, table: str | None = None, device: str = "cpu") -> str:
    """Source of a plugin registering ``methods`` (targets in ``qrt_impl``) and optionally a table."""
    regs = "\n".join(
        f"    register(quantreg.Method(name={m!r}, target='qrt_impl:Impl', devices=({device!r},)))" for m in methods)
    source = f"""
import quantreg
from pathlib import Path


@quantreg.hookimpl
def register_methods(register):
{regs or "    pass"}
"""
    if table:
        source += f"""

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name({table!r}))
"""
    return source


def add_plugin(site: PluginSite, name: str, *methods: str, rules: str | None = None, device: str = "cpu") -> None:
    """Distribution ``qrt-<name>`` with entry point ``<name> = qrt_<name>`` (and its table if ``rules``)."""
    table = f"qrt_{name}_rules.yaml" if rules else None
    files = {table: "version: 1\nrules:\n" + rules} if table and rules else {}
    site.add(f"qrt-{name}", {name: f"qrt_{name}"},
             modules={f"qrt_{name}": methods_plugin(*methods, table=table, device=device),
                      "qrt_impl": IMPL.format(cls="Impl")},
             files=files)


def info(registry: Registry, name: str) -> tuple[str, str]:
    [found] = [p for p in registry.plugin_infos if p.name == name]
    return found.status, found.reason


# -- discovery -----------------------------------------------------------------------------
@pytest.mark.usefixtures("vllm_not_loaded")
def test_plugin_registers_a_method_and_a_table(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast", rules="  - match: {quant_format: fmt_a, device: cpu}\n"
                                                          "    method: alpha_fast\n")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha"})
    assert registry.problems == () and plugin_failures(registry) == []
    [plugin] = [p for p in registry.plugin_infos if p.name == "alpha"]
    assert (plugin.distribution, plugin.version, plugin.value, plugin.status) == ("qrt-alpha", "0.1", "qrt_alpha",
                                                                                  "loaded")
    method = registry.methods["alpha_fast"]
    assert method.plugin == "alpha" and method.target == "qrt_impl:Impl" and method.devices == ("cpu",)
    table_path = str(plugin_site.root / "qrt_alpha_rules.yaml")
    assert [(t.path, t.tier) for t in registry.tables if t.tier is Tier.PLUGIN] == [(table_path, Tier.PLUGIN)]
    decision = registry.resolve(Key("fmt_a", "any_model", "cpu"))
    assert decision.method == "alpha_fast"
    assert decision.source == f"{table_path}:3"
    assert decision.rule is not None and decision.rule.tier is Tier.PLUGIN
    assert [(c.won, c.reason) for c in decision.candidates] == [
        (True, "highest precedence (tier, then specificity, then priority)"),
        (False, "lower tier (default < plugin)"),
    ]
    assert decision.chain[0].plugin == "alpha"
    assert "qrt_impl" not in sys.modules  # nothing imported the method's target
    assert registry.methods["alpha_fast"].load().__name__ == "Impl"
    # a key the plugin table does not claim still gets the default
    assert registry.resolve(Key("fmt_a", "any_model", "hpu")).method == "vllm"


def test_without_an_allow_list_every_plugin_is_discovered(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    add_plugin(plugin_site, "beta", "beta_fast")
    registry = Registry.build(env={})
    assert info(registry, "alpha") == ("loaded", "")
    assert info(registry, "beta") == ("loaded", "")
    assert {"alpha_fast", "beta_fast", "vllm"} <= set(registry.methods)


@pytest.mark.parametrize(("env", "why", "failures"), [
    ({"QUANTREG_PLUGINS": " alpha , ghost"}, "not in QUANTREG_PLUGINS",
     ["plugin 'ghost': named in QUANTREG_PLUGINS but no such entry point is installed"]),
    ({"QUANTREG_DISABLE_PLUGINS": "beta,unknown"}, "listed in QUANTREG_DISABLE_PLUGINS", []),
], ids=["allow-list", "deny-list"])
def test_allow_and_deny_lists(plugin_site: PluginSite, env: dict[str, str], why: str, failures: list[str]) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    add_plugin(plugin_site, "beta", "beta_fast")
    registry = Registry.build(env=env)
    assert info(registry, "alpha") == ("loaded", "")
    assert info(registry, "beta") == ("disabled", why)
    assert "beta_fast" not in registry.methods
    assert "qrt_beta" not in sys.modules  # a disabled plugin is never imported
    assert plugin_failures(registry) == failures


def test_empty_allow_list_loads_no_plugin(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    registry = Registry.build(env={"QUANTREG_PLUGINS": ""})
    assert info(registry, "alpha") == ("disabled", "not in QUANTREG_PLUGINS")
    assert set(registry.methods) == {"vllm"}  # the built-in is not an entry point; it is always there


def test_deny_list_wins_over_the_allow_list(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    add_plugin(plugin_site, "beta", "beta_fast")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,beta", "QUANTREG_DISABLE_PLUGINS": "alpha"})
    assert info(registry, "alpha") == ("disabled", "listed in QUANTREG_DISABLE_PLUGINS")
    assert info(registry, "beta") == ("loaded", "")


def test_environment_of_the_process_is_read_by_default(plugin_site: PluginSite,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    monkeypatch.setenv("QUANTREG_DISABLE_PLUGINS", "alpha")
    assert info(Registry.build(), "alpha") == ("disabled", "listed in QUANTREG_DISABLE_PLUGINS")


# -- faults stay with their plugin -----------------------------------------------------------
def test_misspelled_hook_is_a_failure_naming_plugin_and_hook(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    plugin_site.add("qrt-typo", {"typo": "qrt_typo"}, modules={"qrt_typo": """
import quantreg


@quantreg.hookimpl
def register_method(register):
    register(quantreg.Method(name="typo_method", target="qrt_typo:X"))
"""})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,typo"})
    status, reason = info(registry, "typo")
    assert status == "failed"
    [failure] = registry.failures
    assert failure.plugin == "typo"
    assert "unknown hook 'register_method'" in failure.message
    assert ("quantreg hooks are: doctor_findings, register_methods, register_quant_config_keepers, "
            "register_tables, register_vllm_limitations") in failure.message
    assert reason == failure.message
    assert str(failure).startswith("plugin 'typo': unknown hook 'register_method'")
    assert not registry.plugins.pm.has_plugin("typo")
    assert "alpha_fast" in registry.methods and "typo_method" not in registry.methods


def test_hookimpl_with_a_wrong_argument_is_a_failure(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-args", {"args": "qrt_args"}, modules={"qrt_args": """
import quantreg


@quantreg.hookimpl
def register_methods(add):
    add(quantreg.Method(name="never", target="qrt_args:X"))
"""})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "args"})
    assert info(registry, "args")[0] == "failed"
    [failure] = registry.failures
    assert failure.plugin == "args" and "register_methods" in failure.message and "add" in failure.message
    assert "never" not in registry.methods


def test_plugin_that_fails_to_import(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    plugin_site.add("qrt-broken", {"broken": "qrt_broken"}, modules={"qrt_broken": """
import quantreg
raise RuntimeError("missing native library libfoo.so")
"""})
    plugin_site.add("qrt-gone", {"gone": "qrt_gone_nowhere"})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,broken,gone"})
    assert info(registry, "broken") == (
        "failed", "entry point qrt_broken failed to import: RuntimeError: missing native library libfoo.so")
    status, reason = info(registry, "gone")
    assert status == "failed" and "ModuleNotFoundError" in reason and "qrt_gone_nowhere" in reason
    assert sorted(f.plugin for f in registry.failures) == ["broken", "gone"]
    assert info(registry, "alpha") == ("loaded", "")
    assert "alpha_fast" in registry.methods


def test_hook_that_raises_spares_the_other_plugins(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast", rules="  - match: {quant_format: fmt_a}\n    method: alpha_fast\n")
    plugin_site.add("qrt-raiser", {"raiser": "qrt_raiser"}, modules={"qrt_raiser": """
import quantreg


@quantreg.hookimpl
def register_methods(register):
    raise RuntimeError("boom")


@quantreg.hookimpl
def register_tables(register):
    raise ValueError("no tables today")
"""})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,raiser"})
    assert plugin_failures(registry) == [
        "plugin 'raiser', hook 'register_methods': raised RuntimeError: boom",
        "plugin 'raiser', hook 'register_tables': raised ValueError: no tables today",
    ]
    assert info(registry, "raiser") == ("loaded", "")  # it loaded; its hooks failed
    assert registry.resolve(Key("fmt_a", "m", "cpu")).method == "alpha_fast"


def test_duplicate_method_names_across_plugins_name_both(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "shared", "alpha_only")
    add_plugin(plugin_site, "beta", "shared", "beta_only")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,beta"})
    assert plugin_failures(registry) == [
        "plugin 'beta', hook 'register_methods': method 'shared' is already registered by plugin 'alpha'; "
        "the first one is kept"]
    # plugins are called in the documented order (built-in first, then entry points by name)
    assert registry.methods["shared"].plugin == "alpha"
    assert registry.methods["beta_only"].plugin == "beta"


def test_plugins_cannot_take_over_the_builtin_vllm_method(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "hijack", "vllm")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "hijack"})
    assert registry.methods["vllm"].plugin == "quantreg.builtin"
    assert registry.methods["vllm"].target == "quantreg.builtin:KeepVllm"
    assert plugin_failures(registry) == [
        "plugin 'hijack', hook 'register_methods': method 'vllm' is already registered by plugin "
        "'quantreg.builtin'; the first one is kept"]


def test_plugin_tables_claiming_the_same_key_are_ambiguous(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast", rules="  - match: {quant_format: fmt_x, device: cpu}\n"
                                                          "    method: alpha_fast\n")
    add_plugin(plugin_site, "beta", "beta_fast", rules="  - {match: {device: cpu}, method: beta_fast, priority: 1}\n"
                                                        "  - match: {quant_format: fmt_x, device: [cpu, hpu]}\n"
                                                        "    method: beta_fast\n")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,beta"})
    alpha = plugin_site.root / "qrt_alpha_rules.yaml"
    beta = plugin_site.root / "qrt_beta_rules.yaml"
    [problem] = registry.problems
    assert problem.key == "rules[1].match" and "ambiguous" in problem.message
    text = str(problem)
    assert f"{alpha}:3" in text and f"{beta}:4" in text
    assert "plugin tier" in text
    # both files are left out; the default table answers
    assert [t.tier for t in registry.tables] == [Tier.DEFAULT]
    decision = registry.resolve(Key("fmt_x", "m", "cpu"))
    assert decision.method == "vllm" and decision.rule is not None and decision.rule.tier is Tier.DEFAULT


def test_plugin_table_with_unknown_method_is_reported_and_left_out(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast", rules="  - match: {quant_format: fmt_a}\n    method: alpah_fast\n")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha"})
    [problem] = registry.problems
    assert str(problem).startswith(f"{plugin_site.root / 'qrt_alpha_rules.yaml'}:4: rules[0].method: "
                                   "unknown method 'alpah_fast'; did you mean 'alpha_fast'?")
    assert [t.tier for t in registry.tables] == [Tier.DEFAULT]


def test_bad_registrations_are_failures_and_good_ones_stay(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-sloppy", {"sloppy": "qrt_sloppy"}, modules={"qrt_sloppy": """
import quantreg


@quantreg.hookimpl
def register_methods(register):
    register("not a method")
    register(quantreg.Method(name="bad name", target="qrt_x:Y"))
    register(quantreg.Method(name="no_colon", target="qrt_x.Y"))
    register(quantreg.Method(name="bad_version", target="qrt_x:Y", vllm_version="~=0.3"))
    register(quantreg.Method(name="fine", target="qrt_x:Y", vllm_version=">=0.30,<0.40"))


@quantreg.hookimpl
def register_tables(register):
    register(42)
"""})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "sloppy"})
    assert plugin_failures(registry) == [
        "plugin 'sloppy', hook 'register_methods': register() expects a quantreg.Method, got str",
        "plugin 'sloppy', hook 'register_methods': method name 'bad name' is not valid "
        "(letters, digits, '_', '.', '-')",
        "plugin 'sloppy', hook 'register_methods': method 'no_colon': target 'qrt_x.Y' is not of the form "
        "'package.module:Class'",
        "plugin 'sloppy', hook 'register_methods': method 'bad_version': vllm_version cannot read version clause "
        "'~=0.3'; expected e.g. '>=0.30,<0.40'",
        "plugin 'sloppy', hook 'register_tables': register() expects a path, got int",
    ]
    assert set(registry.methods) == {"vllm", "fine"}


def test_same_module_under_two_entry_points(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast")
    plugin_site.add("qrt-alias", {"zalias": "qrt_alpha"})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "alpha,zalias"})
    assert info(registry, "alpha") == ("loaded", "")
    assert info(registry, "zalias")[0] == "failed"
    assert registry.plugins.pm.has_plugin("alpha")  # the first registration is untouched
    assert registry.methods["alpha_fast"].plugin == "alpha"


# -- built-ins use the same hooks ------------------------------------------------------------
def test_builtin_vllm_method_is_registered_through_the_hooks() -> None:
    plugins = Plugins(env={}, entry_points=False)
    assert [(p.name, p.status, p.value) for p in plugins.infos] == [("quantreg.builtin", "builtin",
                                                                     "quantreg.builtin")]
    impls = plugins.pm.hook.register_methods.get_hookimpls()
    assert [i.plugin_name for i in impls] == ["quantreg.builtin"]
    registry = Registry.build(env={}, entry_points=False)
    vllm = registry.methods["vllm"]
    assert vllm.plugin == "quantreg.builtin" and vllm.target == "quantreg.builtin:KeepVllm"
    assert registry.availability("vllm", "anything").ok
    assert sorted(n for n in dir(plugins.pm.hook) if not n.startswith("_")) == [
        "doctor_findings", "register_methods", "register_quant_config_keepers", "register_tables",
        "register_vllm_limitations"]


def test_plugin_objects_can_be_added_directly() -> None:

    class Embedded:
        @quantreg.hookimpl
        def register_methods(self, register):  # type: ignore[no-untyped-def]
            register(quantreg.Method(name="embedded", target="qrt_nowhere:X"))

    registry = Registry.build(env={}, entry_points=False, plugins=[("embedded-plugin", Embedded())])
    assert registry.methods["embedded"].plugin == "embedded-plugin"
    assert ("embedded-plugin", "loaded") in [(p.name, p.status) for p in registry.plugin_infos]


# -- the CLI sees the same -----------------------------------------------------------------
def test_cli_plugins_and_list_show_entry_point_plugins(plugin_site: PluginSite) -> None:
    add_plugin(plugin_site, "alpha", "alpha_fast", rules="  - match: {quant_format: fmt_a, device: cpu}\n"
                                                          "    method: alpha_fast\n")
    plugin_site.add("qrt-typo", {"typo": "qrt_typo"}, modules={"qrt_typo": """
import quantreg


@quantreg.hookimpl
def register_tables_(register):
    pass
"""})
    env = plugin_site.env(QUANTREG_PLUGINS="alpha,typo")
    out = run_cli("plugins", "--json", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    statuses = {p["name"]: (p["status"], p["distribution"]) for p in data["plugins"]}
    assert {k: v for k, v in statuses.items() if v[0] != "disabled"} == {  # other installed plugins: disabled
        "quantreg.builtin": ("builtin", "quantreg"), "alpha": ("loaded", "qrt-alpha"), "typo": ("failed", "qrt-typo")}
    assert any("plugin 'typo'" in f and "register_tables_" in f for f in data["faults"])
    text = run_cli("plugins", env=env).stdout
    assert "loaded   alpha  (qrt-alpha 0.1)" in text and "failed   typo" in text

    out = run_cli("list", "--json", "--device", "cpu", env=env)
    rows = {r["name"]: r for r in json.loads(out.stdout)["methods"]}
    assert rows["alpha_fast"]["plugin"] == "alpha" and rows["alpha_fast"]["available"] is True
    assert rows["vllm"]["plugin"] == "quantreg.builtin"
    assert "register_tables_" in out.stderr  # faults are warned about on stderr

    out = run_cli("explain", "fmt_a", "m", "cpu", env=env)
    assert out.returncode == 0
    assert "method   alpha_fast" in out.stdout
    assert f"{plugin_site.root / 'qrt_alpha_rules.yaml'}:3 (plugin tier)" in out.stdout

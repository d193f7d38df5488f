import sys

import pytest

from kvtier.common.plugins import PluginRegistry


class Base:
    pass


class Plugin(Base):
    pass


class Unrelated:
    pass


class LookupFailed(ValueError):
    pass


def make_registry():
    return PluginRegistry("widget", Base, LookupFailed, {"plugin": f"{__name__}:Plugin"})


def test_builtin_names_resolve_to_their_class():
    registry = make_registry()
    assert registry.names() == ["plugin"]
    assert registry.target("plugin") == (__name__, "Plugin")
    assert registry.target("other") is None
    assert registry.import_class(*registry.target("plugin")) is Plugin


def test_import_errors_name_the_module_the_class_and_what_is_there():
    registry = make_registry()
    with pytest.raises(LookupFailed, match=r"^cannot import widget module 'no_such_mod': "):
        registry.import_class("no_such_mod", "Plugin")
    with pytest.raises(LookupFailed) as err:
        registry.import_class(__name__, "Missing")
    assert str(err.value) == (f"module {__name__!r} has no class 'Missing'; widget classes in "
                              f"it: ['Plugin']")
    with pytest.raises(LookupFailed, match=r"Unrelated is not a subclass of .*\.Base$"):
        registry.import_class(__name__, "Unrelated")


def test_register_refuses_duplicates_and_malformed_targets():
    registry = make_registry()
    registry.register("again", f"{__name__}:Plugin")
    assert registry.names() == ["again", "plugin"]
    with pytest.raises(ValueError, match="widget 'plugin' is already registered"):
        registry.register("plugin", f"{__name__}:Plugin")
    with pytest.raises(ValueError, match="must look like 'package.module:ClassName'"):
        registry.register("bad", f"{__name__}.Plugin")


def test_a_module_whose_store_client_is_not_installed_names_the_extra(monkeypatch):
    # sys.modules[name] = None makes `import name` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "boto3", None)
    monkeypatch.delitem(sys.modules, "kvtier.offload.tiers.obj", raising=False)
    with pytest.raises(LookupFailed) as err:
        make_registry().import_class("kvtier.offload.tiers.obj", "ObjTier")
    assert str(err.value) == ("widget module 'kvtier.offload.tiers.obj' needs the package "
                              "'boto3', which is not installed: pip install 'kvtier[stores]'")

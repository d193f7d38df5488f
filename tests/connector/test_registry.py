"""Resolving kv_connector to a class: built-ins (lazily), out-of-tree modules, clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.connector import (
    ConnectorLookupError,
    KVConnectorRole,
    KVTransferConfig,
    create_connector,
    get_connector_class,
    registry,
)
from kvtier.connector.example import (
    ExampleConnector,
    ExampleConnectorScheduler,
    ExampleConnectorWorker,
)
from kvtier.connector.multi import MultiConnector

from . import kvtier_test_connectors as plugins
from .connector_testing import CONTEXT, PLUGINS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_builtin_names_resolve():
    assert registry.registered_connectors() == ["ExampleConnector", "MultiConnector",
                                                "OffloadingConnector", "P2PConnector"]
    assert get_connector_class(KVTransferConfig("ExampleConnector")) is ExampleConnector
    # These two parse their options with the config: it must be a valid one.
    multi = KVTransferConfig("MultiConnector", kv_connector_extra_config={
        "connectors": [{"kv_connector": "ExampleConnector"}]})
    assert get_connector_class(multi) is MultiConnector
    offloading = get_connector_class(KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": "1MiB"}))
    assert (offloading.__module__, offloading.__name__) == ("kvtier.connector.offloading",
                                                            "OffloadingConnector")


def test_create_connector_builds_the_requested_half(tmp_path):
    config = KVTransferConfig("ExampleConnector",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, CONTEXT)
    worker = create_connector(config, KVConnectorRole.WORKER, CONTEXT)
    assert type(scheduler) is ExampleConnectorScheduler
    assert type(worker) is ExampleConnectorWorker
    assert (scheduler.config, scheduler.context, worker.config, worker.context) == \
        (config, CONTEXT, config, CONTEXT)
    worker.shutdown()


def test_importing_the_package_imports_no_connector_and_no_torch():
    code = ("import sys, kvtier.connector; "
            "print(sorted(m for m in sys.modules if m.startswith('kvtier.connector.')), "
            "'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip() == ("['kvtier.connector.base', 'kvtier.connector.config', "
                                     "'kvtier.connector.registry'] False")


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConnectorLookupError) as err:
        get_connector_class(KVTransferConfig("ExampleConector"))
    assert str(err.value) == (
        "unknown kv_connector 'ExampleConector'; registered connectors are ['ExampleConnector', "
        "'MultiConnector', 'OffloadingConnector', 'P2PConnector'] (or set "
        "kv_connector_module_path to load one from your own module)")


def test_module_path_loads_an_out_of_tree_connector():
    config = KVTransferConfig("RecordingConnector", kv_connector_module_path=PLUGINS)
    assert get_connector_class(config) is plugins.RecordingConnector
    worker = create_connector(config, KVConnectorRole.WORKER, CONTEXT)
    assert type(worker) is plugins.RecordingWorker


def test_module_path_errors():
    with pytest.raises(ConnectorLookupError,
                       match=r"^cannot import connector module 'no_such_pkg\.connectors': "
                             r"No module named 'no_such_pkg' \(is it on PYTHONPATH\?\)$"):
        get_connector_class(KVTransferConfig("X",
                                             kv_connector_module_path="no_such_pkg.connectors"))
    with pytest.raises(ConnectorLookupError) as err:
        get_connector_class(KVTransferConfig("Recorder", kv_connector_module_path=PLUGINS))
    assert str(err.value) == (
        "module 'tests.connector.kvtier_test_connectors' has no class 'Recorder'; connector "
        "classes in it: ['FaultyLoadConnector', 'HalfMissingConnector', 'RecordingConnector', "
        "'SendingConnector', 'TaggedConnector', 'UndecidedConnector']")
    with pytest.raises(ConnectorLookupError,
                       match=r"^tests\.connector\.kvtier_test_connectors\.NotAConnector is not a "
                             r"subclass of .*KVConnectorBase$"):
        get_connector_class(KVTransferConfig("NotAConnector", kv_connector_module_path=PLUGINS))
    with pytest.raises(ConnectorLookupError, match=r"^HalfMissingConnector\.worker_cls must be "
                                                   r"a subclass of KVConnectorWorker"):
        get_connector_class(KVTransferConfig("HalfMissingConnector",
                                             kv_connector_module_path=PLUGINS))


def test_register_connector_is_lazy_and_refuses_duplicates(monkeypatch):
    monkeypatch.setattr(registry._REGISTRY, "_targets", dict(registry._REGISTRY._targets))
    registry.register_connector("Recording", f"{PLUGINS}:RecordingConnector")
    assert get_connector_class(KVTransferConfig("Recording")) is plugins.RecordingConnector
    with pytest.raises(ValueError, match="connector 'Recording' is already registered"):
        registry.register_connector("Recording", f"{PLUGINS}:RecordingConnector")
    with pytest.raises(ValueError, match="must look like 'package.module:ClassName'"):
        registry.register_connector("Other", f"{PLUGINS}.RecordingConnector")

"""The site's fabric (transfer.protocol, transfer.device, cluster.mpi_provider) reaches every
Mooncake endpoint and MPI process: exported once, read back by TransferEndpoint (Mooncake faked)."""

import pytest

from gyre.cells.config import ClusterConfig
from gyre.coordinator.config import GyreConfig
from gyre.errors import ConfigError
from gyre.transfer import engine as transfer_engine
from gyre.transfer.config import TransferConfig
from gyre.transfer.engine import TransferEndpoint


class _FakeMooncake:
    """Records what `initialize` got and whether MC_FORCE_TCP was set then (Mooncake reads it there)."""

    calls: list = []

    def initialize(self, host, metadata, protocol, device):
        import os

        self.calls.append((protocol, device, os.environ.get("MC_FORCE_TCP")))
        return 0

    def get_rpc_port(self):
        return 1234


@pytest.fixture
def fake_mooncake(monkeypatch):
    _FakeMooncake.calls = []
    monkeypatch.setattr(transfer_engine, "_import_engine", lambda: _FakeMooncake)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    return _FakeMooncake.calls


def test_every_endpoint_takes_the_exported_fabric_and_tcp_is_forced(fake_mooncake, monkeypatch):
    for key, value in TransferConfig(protocol="rdma", device="mlx5_0,mlx5_1").env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MC_FORCE_TCP", "1")  # a site's leftover must not turn rdma into tcp
    assert TransferEndpoint("10.0.0.5").protocol == "rdma"
    for key, value in TransferConfig().env().items():
        monkeypatch.setenv(key, value)
    TransferEndpoint("10.0.0.5")
    assert fake_mooncake == [("rdma", "mlx5_0,mlx5_1", None), ("tcp", "", "1")]


def test_without_an_exported_fabric_endpoints_use_tcp(fake_mooncake, monkeypatch):
    monkeypatch.delenv("GYRE_TRANSFER_PROTOCOL", raising=False)
    monkeypatch.delenv("GYRE_TRANSFER_DEVICE", raising=False)
    assert TransferEndpoint().protocol == "tcp" and fake_mooncake == [("tcp", "", "1")]


def test_the_run_exports_the_fabric_and_the_mpi_provider_only_where_set():
    cfg = GyreConfig(cluster=ClusterConfig(mpi_provider="verbs;ofi_rxm"), transfer=TransferConfig(protocol="rdma"))
    assert cfg.site_env() == {
        "GYRE_TRANSFER_PROTOCOL": "rdma",
        "GYRE_TRANSFER_DEVICE": "",
        "FI_PROVIDER": "verbs;ofi_rxm",
    }
    assert "FI_PROVIDER" not in GyreConfig(cluster=ClusterConfig()).site_env()  # unset: the env's, else tcp


@pytest.mark.parametrize(
    "make, key",
    [
        pytest.param(lambda: TransferConfig(protocol="ib"), "protocol", id="unknown-protocol"),
        pytest.param(
            lambda: TransferConfig(protocol="rdma", device="mlx5_0 mlx5_1"), "device", id="nic-list-with-space"
        ),
        pytest.param(lambda: ClusterConfig(mpi_provider=""), "mpi_provider", id="empty-provider"),
    ],
)
def test_a_bad_fabric_is_refused_naming_its_key(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.key == key

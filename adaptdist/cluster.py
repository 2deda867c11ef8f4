"""The cluster: the ranks a job runs on and how they communicate.

This minimal version describes N local ranks of one device kind. A cluster file
is YAML::

    schema_version: 1
    hosts:
      - name: localhost
        device_kind: cpu        # cpu (gloo) or cuda (nccl)
        num_devices: 2

Later issues add per-device speeds and links; the schema version guards them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import ClusterSpecError

SCHEMA_VERSION = 1
_DEVICE_KINDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class Host:
    """One machine: ``num_devices`` ranks of kind ``device_kind``."""

    name: str
    device_kind: str
    num_devices: int

    def __post_init__(self) -> None:
        if self.device_kind not in _DEVICE_KINDS:
            raise ClusterSpecError(
                f"host {self.name!r}: device_kind {self.device_kind!r} is not one of "
                f"{sorted(_DEVICE_KINDS)}"
            )
        if not isinstance(self.num_devices, int) or isinstance(self.num_devices, bool) or self.num_devices < 1:
            raise ClusterSpecError(
                f"host {self.name!r}: num_devices must be a positive integer, got {self.num_devices!r}"
            )


@dataclass(frozen=True)
class Cluster:
    """A frozen description of the ranks of a job.

    Ranks are numbered host by host, device by device.
    """

    hosts: tuple[Host, ...]

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ClusterSpecError("cluster: 'hosts' must list at least one host")
        kinds = {h.device_kind for h in self.hosts}
        if len(kinds) > 1:
            raise ClusterSpecError(
                f"cluster: mixed device kinds {sorted(kinds)} are not supported yet; use one kind"
            )
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ClusterSpecError(f"cluster: duplicate host names in {names}")

    @property
    def world_size(self) -> int:
        return sum(h.num_devices for h in self.hosts)

    @property
    def device_kind(self) -> str:
        return self.hosts[0].device_kind

    @property
    def backend(self) -> str:
        """The torch.distributed backend for this device kind (gloo on CPU, nccl on CUDA)."""
        return _DEVICE_KINDS[self.device_kind]

    def __repr__(self) -> str:
        hosts = ", ".join(f"{h.name}:{h.num_devices}x{h.device_kind}" for h in self.hosts)
        return f"Cluster({hosts})"

    @staticmethod
    def local(nproc: int, device_kind: str = "cpu") -> "Cluster":
        """N local ranks on this machine.

        Raises:
            ClusterSpecError: ``nproc`` is not a positive integer.
        """
        if not isinstance(nproc, int) or nproc < 1:
            raise ClusterSpecError(
                f"--nproc must be a positive number of local ranks, got {nproc!r}; try --nproc 2"
            )
        return Cluster((Host("localhost", device_kind, nproc),))

    @staticmethod
    def from_yaml(path: str | os.PathLike) -> "Cluster":
        """Load a cluster file (see the module docstring for the schema).

        Raises:
            ClusterSpecError: the file is missing, is not YAML, or a field is
                missing or has the wrong type; the message names the file and field.
        """
        p = Path(path)
        if not p.is_file():
            raise ClusterSpecError(f"cluster file {str(p)!r} does not exist")
        try:
            doc = yaml.safe_load(p.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ClusterSpecError(f"cluster file {str(p)!r} is not valid YAML: {e}") from None
        return Cluster.from_dict(doc, source=str(p))

    @staticmethod
    def from_dict(doc: object, source: str = "<dict>") -> "Cluster":
        """Build from the parsed YAML document; see :meth:`from_yaml`."""

        def fail(field: str, why: str) -> ClusterSpecError:
            return ClusterSpecError(f"cluster file {source!r}: field '{field}' {why}")

        if not isinstance(doc, dict):
            raise ClusterSpecError(f"cluster file {source!r}: expected a mapping at top level, got {type(doc).__name__}")
        if "schema_version" not in doc:
            raise fail("schema_version", f"is missing; add 'schema_version: {SCHEMA_VERSION}'")
        if type(doc["schema_version"]) is not int or doc["schema_version"] != SCHEMA_VERSION:  # not True, 1.0
            raise fail("schema_version", f"is {doc['schema_version']!r}; this adaptdist reads version {SCHEMA_VERSION}")
        unknown_top = set(doc) - {"schema_version", "hosts"}
        if unknown_top:
            raise ClusterSpecError(
                f"cluster file {source!r}: unknown top-level keys {sorted(map(str, unknown_top))}; "
                f"schema version {SCHEMA_VERSION} has only 'schema_version' and 'hosts'"
            )
        hosts = doc.get("hosts")
        if hosts is None:
            raise fail("hosts", "is missing; list at least one host with name, device_kind, num_devices")
        if not isinstance(hosts, list) or not hosts:
            got = "an empty list" if isinstance(hosts, list) else f"a {type(hosts).__name__}"
            raise fail("hosts", f"must be a non-empty list of hosts, got {got}")
        parsed = []
        for i, h in enumerate(hosts):
            if not isinstance(h, dict):
                raise fail(f"hosts[{i}]", f"must be a mapping, got {type(h).__name__}")
            for key, typ in (("name", str), ("device_kind", str), ("num_devices", int)):
                if key not in h:
                    raise fail(f"hosts[{i}].{key}", "is missing")
                if not isinstance(h[key], typ) or isinstance(h[key], bool):
                    raise fail(f"hosts[{i}].{key}", f"must be {typ.__name__}, got {h[key]!r}")
            unknown = set(h) - {"name", "device_kind", "num_devices"}
            if unknown:
                raise fail(f"hosts[{i}]", f"has unknown keys {sorted(unknown)}")
            try:
                parsed.append(Host(h["name"], h["device_kind"], h["num_devices"]))
            except ClusterSpecError as e:
                raise ClusterSpecError(f"cluster file {source!r}: {e}") from None
        try:
            return Cluster(tuple(parsed))
        except ClusterSpecError as e:
            raise ClusterSpecError(f"cluster file {source!r}: {e}") from None

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "hosts": [
                {"name": h.name, "device_kind": h.device_kind, "num_devices": h.num_devices}
                for h in self.hosts
            ],
        }

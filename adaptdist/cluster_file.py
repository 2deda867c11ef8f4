"""The cluster file: YAML (or JSON, which YAML reads too) to and from :class:`adaptdist.cluster.Cluster`.

Schema version 2::

    schema_version: 2
    hosts:
      - name: localhost
        devices:                      # one entry per rank; ranks are 0..N-1, each once
          - rank: 0
            kind: cpu                 # cpu (gloo) or cuda (nccl); kinds may mix
            cores: 1.0                # cpu only, optional: this rank's share of the host's cores
            peak_flops: {float32: 1.6e+11, bfloat16: 2.56e+12}   # FLOP/s per dtype; float32 required
            memory_bytes: 12637208576
            memory_bandwidth_bytes_per_s: 1.0e+10
            op_overhead_s: 3.5e-6     # optional: host time of one dispatched op call (measured by profile)
            cpus: [0]                 # cpu only, optional: pin this rank to these core ids (the launcher and
                                      #   `cluster profile` apply it; torch runs len(cpus) threads there)
          - {rank: 1, kind: cpu, cores: 1.0, peak_flops: {float32: 1.6e+11},
             memory_bytes: 12637208576, memory_bandwidth_bytes_per_s: 1.0e+10}
    links:
      # a tier default covers every pair of ranks of that tier:
      # intra_host = two ranks on one host, inter_host = ranks on two hosts
      - {tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}
      # a pair entry overrides its tier's default for one pair (its tier is implied)
      - {ranks: [0, 1], bandwidth_bytes_per_s: 2.0e+9, latency_s: 1.5e-4}
    calibration: null                 # null: every figure is an estimate (`adaptdist cluster detect`)

Every tier that occurs in the cluster needs a default or a pair entry for each of its
pairs. ``adaptdist cluster profile`` writes measured figures and a ``calibration``
block with the alpha-beta fit of each collective per link tier::

    calibration:
      measured_at: '2025-01-01T12:00:00+00:00'
      backend: gloo
      torch_version: 2.13.0+cpu
      wall_s: 41.2
      collectives:
        intra_host:
          all_reduce: {alpha_s: 1.9e-4, beta_s_per_byte: 6.8e-10, num_ranks: 2, rms_rel_error: 0.08}
          # all_gather, reduce_scatter, all_to_all, send_recv likewise
        shm:        # adaptdist's shared-memory collectives among one host's ranks (where the kernels load)
          all_reduce: {alpha_s: 2.0e-5, beta_s_per_byte: 2.0e-10, num_ranks: 2}

Numbers may be written ``1.5e9`` (YAML 1.2 style) as well as ``1.5e+9``.

Schema version 1 files (``hosts: [{name, device_kind, num_devices}]``) still load: they carry no
figures, so :func:`load_cluster` asks its ``estimate`` argument for them;
:func:`adaptdist.calibrate.local.load_cluster` passes the estimates of
:func:`adaptdist.calibrate.local.local_cluster` (this machine's cores and memory, shared among the
host's ranks, and default links).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .cluster import (CALIBRATION_TIERS, COLLECTIVES, DEVICE_KINDS, DTYPES, SHM_COLLECTIVES, SHM_TIER, TIERS,
                      Calibration, Cluster, CollectiveFit, Device, FrozenMap, Host, Link, _is_number)
from .errors import ClusterSpecError
from . import limits, safe_load

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)

EstimateCluster = Callable[[tuple[tuple[str, str, int], ...]], Cluster]
"""Builds a cluster from a schema version 1 file's hosts, ``((name, device_kind, num_devices), ...)``,
ranks numbered in that order, with estimated figures; raises ClusterSpecError for a bad kind or count."""


def load_cluster(path: str | os.PathLike, estimate: EstimateCluster | None = None) -> Cluster:
    """Load a cluster file, YAML or JSON (schema in the module docstring; versions 1 and 2; ``estimate``
    gives a version 1 file its figures).

    Raises:
        ClusterSpecError: the file is missing, is not YAML, or a field is missing, has the wrong
            type or an invalid value; the message names the file, the field and the allowed form.
    """
    p = Path(path)
    doc = safe_load.load_yaml_file(p, "cluster file", ClusterSpecError, _Loader)  # bounded: adaptdist/limits.py
    return cluster_from_dict(doc, source=str(p), estimate=estimate)


def cluster_from_dict(doc: object, source: str = "<dict>", estimate: EstimateCluster | None = None) -> Cluster:
    """Build from a parsed document; see :func:`load_cluster`. ``source`` names it in errors."""
    return _Parser(source, estimate).cluster(doc)


def cluster_to_dict(cluster: Cluster) -> dict:
    """The schema-version-2 document (plain dicts, lists, numbers and strings)."""
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "hosts": [], "links": []}
    for h in cluster.hosts:
        devs = []
        for d in h.devices:
            e: dict[str, Any] = {"rank": d.rank, "kind": d.kind}
            if d.cores is not None:
                e["cores"] = d.cores
            e["peak_flops"] = dict(d.peak_flops)
            e["memory_bytes"] = d.memory_bytes
            e["memory_bandwidth_bytes_per_s"] = d.memory_bandwidth_bytes_per_s
            if d.op_overhead_s is not None:
                e["op_overhead_s"] = d.op_overhead_s
            if d.cpus is not None:
                e["cpus"] = list(d.cpus)
            devs.append(e)
        doc["hosts"].append({"name": h.name, "devices": devs})
    for link in cluster.links:
        e = {"tier": link.tier} if link.ranks is None else {"ranks": list(link.ranks)}
        e.update(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s)
        doc["links"].append(e)
    cal = cluster.calibration
    if cal is None:
        doc["calibration"] = None
    else:
        coll: dict[str, dict] = {}
        for (tier, name), fit in cal.collectives.items():
            f = {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte}
            if fit.num_ranks is not None:
                f["num_ranks"] = fit.num_ranks
            if fit.rms_rel_error is not None:
                f["rms_rel_error"] = fit.rms_rel_error
            coll.setdefault(tier, {})[name] = f
        c: dict[str, Any] = {"measured_at": cal.measured_at, "backend": cal.backend,
                             "torch_version": cal.torch_version}
        if cal.wall_s is not None:
            c["wall_s"] = cal.wall_s
        c["collectives"] = coll
        doc["calibration"] = c
    return doc


def write_yaml(cluster: Cluster, path: str | os.PathLike, comment: str = "") -> None:
    """Write the cluster as a schema-version-2 YAML file (``comment`` lines become a header)."""
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    state = ("calibrated: figures measured by `adaptdist cluster profile`" if cluster.calibrated else
             "uncalibrated: every figure is an estimate; `adaptdist cluster profile` measures them")
    text = yaml.dump(cluster_to_dict(cluster), Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)
    Path(path).write_text(f"{head}# adaptdist cluster file; {state}\n{text}")


def write_json(cluster: Cluster, path: str | os.PathLike) -> None:
    """Write the cluster as schema-version-2 JSON (loadable by :func:`load_cluster`)."""
    Path(path).write_text(json.dumps(cluster_to_dict(cluster), indent=1) + "\n")


def save_cluster(cluster: Cluster, path: str | os.PathLike, comment: str = "") -> None:
    """Write JSON when ``path`` ends in ``.json``, else YAML."""
    if str(path).endswith(".json"):
        write_json(cluster, path)
    else:
        write_yaml(cluster, path, comment)


# --- parsing -------------------------------------------------------------------------------------

class _Loader(safe_load.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as ``1.5e9`` (PyYAML's 1.1 rules make it a string), and
    refuses duplicate keys (:mod:`adaptdist.safe_load`)."""


_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)

class _Dumper(yaml.SafeDumper):
    """SafeDumper writing floats in their shortest exact form, large and small ones as ``1.6e+11``."""


def _represent_float(dumper: yaml.SafeDumper, v: float) -> yaml.ScalarNode:
    if not math.isfinite(v) or v == 0 or 1e-3 <= abs(v) < 1e6:
        return yaml.SafeDumper.represent_float(dumper, v)
    text = next(t for t in (f"{v:.{k}e}" for k in range(1, 18)) if float(t) == v)
    mantissa, exp = text.split("e")
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    return dumper.represent_scalar("tag:yaml.org,2002:float", f"{mantissa}e{exp}")


_Dumper.add_representer(float, _represent_float)

_V2_TOP = ("schema_version", "hosts", "links", "calibration")
_V2_DEVICE = ("rank", "kind", "cores", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "op_overhead_s",
              "cpus")
_V2_DEVICE_REQUIRED = ("rank", "kind", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s")
_EXAMPLE_DEVICE = ("{rank: 0, kind: cpu, peak_flops: {float32: 1.0e+11}, memory_bytes: 8589934592, "
                   "memory_bandwidth_bytes_per_s: 1.0e+10}")


class _Parser:
    """Turns a parsed document into a Cluster; every error names the file and the field."""

    def __init__(self, source: str, estimate: EstimateCluster | None = None) -> None:
        self.source = source
        self.estimate = estimate

    def fail(self, path: str, why: str) -> ClusterSpecError:
        return ClusterSpecError(f"cluster file {self.source!r}: field '{path}' {why}")

    def wrap(self, e: ClusterSpecError) -> ClusterSpecError:
        return ClusterSpecError(f"cluster file {self.source!r}: {e}")

    # leaf readers

    def mapping(self, path: str, v: object, allowed: tuple[str, ...], required: tuple[str, ...],
                example: str = "") -> dict:
        if not isinstance(v, dict):
            raise self.fail(path, f"must be a mapping{' like ' + example if example else ''}, got "
                                  f"{type(v).__name__} {v!r}")
        for key in required:
            if key not in v:
                raise self.fail(f"{path}.{key}" if path else key,
                                f"is missing; {path or 'the top level'} needs {', '.join(required)}"
                                + (f", e.g. {example}" if example else ""))
        unknown = sorted(map(str, set(v) - set(allowed)))
        if unknown:
            raise self.fail(path, f"has unknown keys {unknown}; allowed keys: {', '.join(allowed)}")
        return v

    def number(self, path: str, v: object, unit: str, *, zero_ok: bool = False) -> float:
        bad = not _is_number(v) or (v < 0 if zero_ok else v <= 0)
        if bad:
            want = ">= 0" if zero_ok else "> 0"
            raise self.fail(path, f"must be a number of {unit} {want} (e.g. 1.5e+9), got {v!r}")
        absurd = limits.out_of_bounds(path, float(v))
        if absurd:
            raise self.fail(path, absurd)
        return float(v)

    def integer(self, path: str, v: object, what: str, *, minimum: int) -> int:
        if isinstance(v, float) and math.isfinite(v) and v.is_integer() and what == "bytes" and v <= 2**53:
            v = int(v)  # memory_bytes: 8e9
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self.fail(path, f"must be an integer {what} >= {minimum}, got {v!r}")
        absurd = limits.out_of_bounds(path, v)
        if absurd:
            raise self.fail(path, absurd)
        return v

    def kind(self, path: str, v: object) -> str:
        if not isinstance(v, str) or v not in DEVICE_KINDS:
            raise self.fail(path, f"is {v!r}; allowed device kinds: 'cpu' (gloo) or 'cuda' (nccl)")
        return v  # type: ignore[return-value]

    # documents

    def cluster(self, doc: object) -> Cluster:
        if not isinstance(doc, dict):
            raise ClusterSpecError(f"cluster file {self.source!r}: expected a mapping at top level, "
                                   f"got {type(doc).__name__}")
        if "schema_version" not in doc:
            raise self.fail("schema_version", f"is missing; add 'schema_version: {SCHEMA_VERSION}'")
        version = doc["schema_version"]
        if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # not True, 1.0, '2'
            raise self.fail("schema_version", f"is {version!r}; this adaptdist reads version 1 and "
                                              f"version {SCHEMA_VERSION}")
        return self.v1(doc) if version == 1 else self.v2(doc)

    def hosts_list(self, doc: dict, hint: str) -> list:
        hosts = doc.get("hosts")
        if hosts is None:
            raise self.fail("hosts", f"is missing; list at least one host with {hint}")
        if not isinstance(hosts, list) or not hosts:
            got = "an empty list" if isinstance(hosts, list) else f"a {type(hosts).__name__}"
            raise self.fail("hosts", f"must be a non-empty list of hosts, got {got}")
        return hosts

    def v1(self, doc: dict) -> Cluster:
        unknown_top = set(doc) - {"schema_version", "hosts"}
        if unknown_top:
            raise ClusterSpecError(
                f"cluster file {self.source!r}: unknown top-level keys {sorted(map(str, unknown_top))}; "
                f"schema version 1 has only 'schema_version' and 'hosts' (version {SCHEMA_VERSION} adds "
                f"'links' and 'calibration')")
        parsed = []
        for i, h in enumerate(self.hosts_list(doc, "name, device_kind, num_devices")):
            if not isinstance(h, dict):
                raise self.fail(f"hosts[{i}]", f"must be a mapping, got {type(h).__name__}")
            for key, typ in (("name", str), ("device_kind", str), ("num_devices", int)):
                if key not in h:
                    raise self.fail(f"hosts[{i}].{key}", "is missing")
                if not isinstance(h[key], typ) or isinstance(h[key], bool):
                    raise self.fail(f"hosts[{i}].{key}", f"must be {typ.__name__}, got {h[key]!r}")
            unknown = set(h) - {"name", "device_kind", "num_devices"}
            if unknown:
                raise self.fail(f"hosts[{i}]", f"has unknown keys {sorted(map(str, unknown))}")
            parsed.append((h["name"], h["device_kind"], h["num_devices"]))
            if h["num_devices"] < 1:
                raise self.fail(f"hosts[{i}].num_devices", f"must be a positive integer, got {h['num_devices']!r}")
            limits.check_ranks(sum(n for _, _, n in parsed), f"cluster file {self.source!r}: field 'hosts[{i}].num_devices'")
        if self.estimate is None:
            raise self.fail("schema_version", "is 1: such a file has no figures; load it with "
                                              "adaptdist.calibrate.local.load_cluster (this machine's estimates), "
                                              f"or write version {SCHEMA_VERSION} with `adaptdist cluster detect`")
        try:
            return self.estimate(tuple(parsed))
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def v2(self, doc: dict) -> Cluster:
        self.mapping("", doc, _V2_TOP, ("schema_version", "hosts"))
        hosts: list[Host] = []
        seen: dict[int, str] = {}
        limits.check_ranks(sum(len(h["devices"]) for h in self.hosts_list(doc, "name and devices")
                               if isinstance(h, dict) and isinstance(h.get("devices"), list)),
                           f"cluster file {self.source!r}: field 'hosts'")
        for i, h in enumerate(self.hosts_list(doc, "name and devices")):
            hp = f"hosts[{i}]"
            if isinstance(h, dict) and "devices" not in h and ("num_devices" in h or "device_kind" in h):
                raise self.fail(hp, "has the schema version 1 keys device_kind / num_devices; in version 2 a host "
                                    "lists its devices: {name: localhost, devices: [" + _EXAMPLE_DEVICE + ", ...]} "
                                    "(or write 'schema_version: 1' to get estimated figures)")
            self.mapping(hp, h, ("name", "devices"), ("name", "devices"), "{name: localhost, devices: [...]}")
            if not isinstance(h["name"], str) or not h["name"]:
                raise self.fail(f"{hp}.name", f"must be a non-empty string, got {h['name']!r}")
            from .input_checks import host_name_problem

            if host_name_problem(h["name"]):
                raise self.fail(f"{hp}.name", host_name_problem(h["name"]))
            devs = h["devices"]
            if not isinstance(devs, list) or not devs:
                raise self.fail(f"{hp}.devices", f"must be a non-empty list of devices like {_EXAMPLE_DEVICE}, "
                                                 f"got {devs!r}")
            devices = []
            for j, d in enumerate(devs):
                dp = f"{hp}.devices[{j}]"
                devices.append(self.device(dp, d, h["name"]))
                if devices[-1].rank in seen:
                    raise self.fail(f"{dp}.rank", f"is {devices[-1].rank}, already the rank of {seen[devices[-1].rank]}"
                                                  f"; every device needs its own rank, 0..N-1")
                seen[devices[-1].rank] = dp
            try:
                hosts.append(Host(h["name"], tuple(devices)))
            except ClusterSpecError as e:
                raise self.wrap(e) from None
        n = len(seen)
        missing = sorted(set(range(n)) - set(seen))
        if missing:
            raise self.fail("hosts", f"has ranks {sorted(seen)}; ranks must be 0..{n - 1} (missing {missing})")
        links_doc = doc.get("links")
        if links_doc is None:
            raise self.fail("links", "is missing; add e.g. [{tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, "
                                     "latency_s: 2.0e-4}] (one entry per link tier the cluster uses)")
        if not isinstance(links_doc, list):
            raise self.fail("links", f"must be a list of links, got {type(links_doc).__name__}")
        host_of = {d.rank: h.name for h in hosts for d in h.devices}
        links = [self.link(f"links[{k}]", e, host_of) for k, e in enumerate(links_doc)]
        calibration = self.calibration(doc.get("calibration"))
        try:
            return Cluster(tuple(hosts), tuple(links), calibration)
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def device(self, dp: str, d: object, host: str) -> Device:
        self.mapping(dp, d, _V2_DEVICE, _V2_DEVICE_REQUIRED, _EXAMPLE_DEVICE)
        assert isinstance(d, dict)
        rank = self.integer(f"{dp}.rank", d["rank"], "rank", minimum=0)
        kind = self.kind(f"{dp}.kind", d["kind"])
        pf = d["peak_flops"]
        if not isinstance(pf, dict) or "float32" not in pf:
            raise self.fail(f"{dp}.peak_flops", f"must map dtype names to FLOP/s and include float32, e.g. "
                                                f"{{float32: 1.0e+11, bfloat16: 2.0e+11}}; got {pf!r}")
        flops = {}
        for dt, v in pf.items():
            if dt not in DTYPES:
                raise self.fail(f"{dp}.peak_flops", f"has unknown dtype {dt!r}; allowed: {', '.join(DTYPES)}")
            flops[dt] = self.number(f"{dp}.peak_flops.{dt}", v, "FLOP/s")
        mem = self.integer(f"{dp}.memory_bytes", d["memory_bytes"], "bytes", minimum=1)
        bw = self.number(f"{dp}.memory_bandwidth_bytes_per_s", d["memory_bandwidth_bytes_per_s"], "bytes/s")
        cores = None if d.get("cores") is None else self.number(f"{dp}.cores", d["cores"], "cores")
        if cores is not None and kind != "cpu":
            raise self.fail(f"{dp}.cores", f"is given for a {kind} device; 'cores' is a cpu rank's share of its host's "
                                           "cores: drop it")
        ovh = (None if d.get("op_overhead_s") is None
               else self.number(f"{dp}.op_overhead_s", d["op_overhead_s"], "seconds", zero_ok=True))
        cpus = None if d.get("cpus") is None else self.cpus(f"{dp}.cpus", d["cpus"], kind)
        try:
            return Device(rank, host, kind, flops, mem, bw, cores, ovh, cpus)
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def cpus(self, path: str, v: object, kind: str) -> tuple[int, ...]:
        if kind != "cpu":
            raise self.fail(path, f"pins a cpu rank to cores; this device's kind is {kind!r} (drop 'cpus')")
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if (not isinstance(v, list) or not v
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)):
            raise self.fail(path, f"must be a non-empty list of CPU core ids >= 0, e.g. [0] or [2, 3]; got {v!r}")
        if len(set(v)) != len(v):
            raise self.fail(path, f"lists a core twice: {v!r}; list each core id once")
        return tuple(v)

    def link(self, lp: str, e: object, host_of: dict[int, str]) -> Link:
        n = len(host_of)
        example = "{tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}"
        self.mapping(lp, e, ("tier", "ranks", "bandwidth_bytes_per_s", "latency_s"),
                     ("bandwidth_bytes_per_s", "latency_s"), example)
        assert isinstance(e, dict)
        if "tier" not in e and "ranks" not in e:
            raise self.fail(lp, f"needs 'tier' (a default for every pair of that tier) or 'ranks: [a, b]' "
                                f"(one pair), e.g. {example}")
        ranks = None
        if "ranks" in e:
            r = e["ranks"]
            if (not isinstance(r, list) or len(r) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in r) or r[0] == r[1]):
                raise self.fail(f"{lp}.ranks", f"must be two different ranks [a, b], got {r!r}")
            for x in r:
                if not 0 <= x < n:
                    raise self.fail(f"{lp}.ranks", f"names rank {x}, which does not exist: the devices have "
                                                   f"ranks 0..{n - 1}")
            ranks = (r[0], r[1])
        tier = e.get("tier")
        if tier is not None and tier not in TIERS:
            raise self.fail(f"{lp}.tier", f"is {tier!r}; allowed: 'intra_host' (ranks on one host) or "
                                          f"'inter_host' (ranks on different hosts)")
        if ranks is not None:
            a, b = ranks
            actual = "intra_host" if host_of[a] == host_of[b] else "inter_host"
            if tier is not None and tier != actual:
                raise self.fail(f"{lp}.tier", f"is {tier!r}, but ranks {a} and {b} are on hosts {host_of[a]!r} "
                                              f"and {host_of[b]!r} ({actual}); drop 'tier' from a pair entry")
            tier = actual
        bw = self.number(f"{lp}.bandwidth_bytes_per_s", e["bandwidth_bytes_per_s"], "bytes/s")
        lat = self.number(f"{lp}.latency_s", e["latency_s"], "seconds", zero_ok=True)
        try:
            return Link(tier, bw, lat, ranks)
        except ClusterSpecError as err:
            raise self.wrap(err) from None

    def calibration(self, c: object) -> Calibration | None:
        if c is None:
            return None
        self.mapping("calibration", c, ("measured_at", "backend", "torch_version", "wall_s", "collectives"),
                     ("collectives",))
        assert isinstance(c, dict)
        for key in ("measured_at", "backend", "torch_version"):
            if key in c and not isinstance(c[key], str):
                raise self.fail(f"calibration.{key}", f"must be a string, got {c[key]!r}")
        from .input_checks import calibration_problem

        for key in ("measured_at", "backend"):
            why = calibration_problem(key, c.get(key, ""))
            if why:
                raise self.fail(f"calibration.{key}", why)
        wall = None if c.get("wall_s") is None else self.number("calibration.wall_s", c["wall_s"], "seconds",
                                                                 zero_ok=True)
        coll = c["collectives"]
        if not isinstance(coll, dict) or not coll:
            raise self.fail("calibration.collectives", f"must map tier -> collective -> fit (at least one; "
                                                       f"'calibration: null' when nothing was measured), got {coll!r}")
        fits = {}
        for tier, by_name in coll.items():
            tp = f"calibration.collectives.{tier}"
            if tier not in CALIBRATION_TIERS:
                raise self.fail(tp, f"is not a link tier or 'shm'; allowed: {', '.join(CALIBRATION_TIERS)}")
            if not isinstance(by_name, dict) or not by_name:
                raise self.fail(tp, f"must map collective names to fits (at least one), got {by_name!r}")
            for name, f in by_name.items():
                fp = f"{tp}.{name}"
                allowed = SHM_COLLECTIVES if tier == SHM_TIER else COLLECTIVES
                if name not in allowed:
                    raise self.fail(fp, f"is not a collective; allowed: {', '.join(allowed)}")
                self.mapping(fp, f, ("alpha_s", "beta_s_per_byte", "num_ranks", "rms_rel_error"),
                             ("alpha_s", "beta_s_per_byte"), "{alpha_s: 2.0e-4, beta_s_per_byte: 7.0e-10}")
                assert isinstance(f, dict)
                nr = None if f.get("num_ranks") is None else self.integer(f"{fp}.num_ranks", f["num_ranks"],
                                                                          "ranks", minimum=1)
                err = None if f.get("rms_rel_error") is None else self.number(
                    f"{fp}.rms_rel_error", f["rms_rel_error"], "(relative error)", zero_ok=True)
                fits[(tier, name)] = CollectiveFit(
                    self.number(f"{fp}.alpha_s", f["alpha_s"], "seconds", zero_ok=True),
                    self.number(f"{fp}.beta_s_per_byte", f["beta_s_per_byte"], "seconds per byte"), nr, err)
        return Calibration(FrozenMap(fits), c.get("measured_at", ""), c.get("backend", ""),
                           c.get("torch_version", ""), wall)

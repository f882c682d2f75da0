"""The storage layer's public face: the one module that sandbox/, cli/, criu_hooks/ and agents/ import
from storage (tests/test_layers.py forbids the rest). Each name is loaded from its package on first use, so
a command pays only for what it touches. The packages beneath, from the bottom (each imports only those below
it): base, fs, codecs, format, gpu, repo, pipeline, then tiers, archive, remote and maintenance."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute); attribute None: the name is the module itself
_WHERE: dict[str, tuple[str, str | None]] = {
    "AlignedBuffer": ("storage.fs.directio", 'AlignedBuffer'),
    "ArrivingSource": ("storage.remote.fill", 'ArrivingSource'),
    "BufferPool": ("storage.fs.directio", 'BufferPool'),
    "ChildReads": ("storage.repo.childreads", 'ChildReads'),
    "ChunkError": ("storage.format.chunkfile", 'ChunkError'),
    "ChunkHeader": ("storage.format.chunkfile", 'ChunkHeader'),
    "ChunkRef": ("storage.format.manifest", 'ChunkRef'),
    "CodecError": ("storage.codecs.registry", 'CodecError'),
    "CudaDevice": ("storage.gpu.device", 'CudaDevice'),
    "DEFAULT_JOBS": ("storage.base.limits", 'DEFAULT_JOBS'),
    "DamageError": ("storage.base.errors", 'DamageError'),
    "DamageMarks": ("storage.repo.damage", 'DamageMarks'),
    "DamagedCopy": ("storage.repo.store", 'DamagedCopy'),
    "EXIT_DAMAGED": ("storage.base.errors", 'EXIT_DAMAGED'),
    "EXIT_FAILED": ("storage.base.errors", 'EXIT_FAILED'),
    "EXIT_OK": ("storage.base.errors", 'EXIT_OK'),
    "EXIT_RECOVER": ("storage.base.errors", 'EXIT_RECOVER'),
    "EXIT_UNAVAILABLE": ("storage.base.errors", 'EXIT_UNAVAILABLE'),
    "EXIT_USAGE": ("storage.base.errors", 'EXIT_USAGE'),
    "EncodeProcsError": ("storage.pipeline.encodeprocs", 'EncodeProcsError'),
    "Entry": ("storage.maintenance.retention", 'Entry'),
    "FileTreeSink": ("storage.archive.filetree", 'FileTreeSink'),
    "FileTreeSource": ("storage.archive.filetree", 'FileTreeSource'),
    "FilesCache": ("storage.archive.files_cache", 'FilesCache'),
    "FollowedDirSource": ("storage.archive.follow", 'FollowedDirSource'),
    "GpuEngine": ("storage.pipeline.gpu_engine", 'GpuEngine'),
    "GpusnapError": ("storage.base.errors", 'GpusnapError'),
    "InvalidNameError": ("storage.base.names", 'InvalidNameError'),
    "JOURNAL": ("storage.format.storedir", 'JOURNAL'),
    "LOGS": ("storage.format.storedir", 'LOGS'),
    "Loc": ("storage.format.packs", 'Loc'),
    "MARKER": ("storage.format.storedir", 'MARKER'),
    "Manifest": ("storage.format.manifest", 'Manifest'),
    "PackSource": ("storage.repo.readstage", 'PackSource'),
    "PinnedPool": ("storage.tiers.memory", 'PinnedPool'),
    "WarmTier": ("storage.tiers.warm", 'WarmTier'),
    "WarmError": ("storage.repo.warmread", 'WarmError'),
    "PipelineError": ("storage.pipeline.put", 'PipelineError'),
    "Policy": ("storage.maintenance.retention", 'Policy'),
    "Problem": ("storage.repo.store", 'Problem'),
    "ProcessOwner": ("storage.fs.owner", 'ProcessOwner'),
    "Progress": ("storage.base.progress", 'Progress'),
    "READERS": ("storage.repo.readstage", 'READERS'),
    "RangeReader": ("storage.archive.filetree", 'RangeReader'),
    "Recycler": ("storage.fs.directio", 'Recycler'),
    "Region": ("storage.pipeline.gpu_engine", 'Region'),
    "Remote": ("storage.remote.client", 'Remote'),
    "RemoteConfig": ("storage.remote.config", 'RemoteConfig'),
    "RemoteDamageError": ("storage.remote.client", 'RemoteDamageError'),
    "RemoteError": ("storage.remote.client", 'RemoteError'),
    "RemoteFill": ("storage.remote.fill", 'RemoteFill'),
    "SNAPSHOTS": ("storage.format.storedir", 'SNAPSHOTS'),
    "SettingError": ("storage.base.settings", 'SettingError'),
    "SnapshotStore": ("storage.repo.store", 'SnapshotStore'),
    "Stages": ("storage.pipeline.put", 'Stages'),
    "StoreError": ("storage.repo.store", 'StoreError'),
    "Stream": ("storage.format.manifest", 'Stream'),
    "StreamSpec": ("storage.pipeline.put", 'StreamSpec'),
    "StreamWriter": ("storage.pipeline.put", 'StreamWriter'),
    "UnavailableError": ("storage.base.errors", 'UnavailableError'),
    "WakeProbe": ("storage.base.wakeprobe", 'WakeProbe'),
    "Want": ("storage.repo.readstage", 'Want'),
    "add_remote": ("storage.remote.config", 'add_remote'),
    "address_of": ("storage.fs.directio", 'address_of'),
    "apply_switch_interval": ("storage.base.settings", 'apply_switch_interval'),
    "break_locks": ("storage.repo.locks", 'break_locks'),
    "cat": ("storage.archive.portable", 'cat'),
    "check_tree": ("storage.format.manifest", 'check_tree'),
    "collect": ("storage.maintenance.gc", 'collect'),
    "companion_parent": ("storage.maintenance.retention", 'companion_parent'),
    "compute": ("storage.maintenance.stats", 'compute'),
    "copy_into": ("storage.fs.directio", 'copy_into'),
    "decide": ("storage.maintenance.retention", 'decide'),
    "Duration": ("storage.maintenance.retention", 'Duration'),
    "decode_host": ("storage.codecs.registry", 'decode_host'),
    "decode_host_into": ("storage.codecs.registry", 'decode_host_into'),
    "default_store_path": ("storage.repo.store", 'default_store_path'),
    "delta": ("storage.codecs.delta", None),
    "diff": ("storage.maintenance.stats", 'diff'),
    "encode_procs": ("storage.pipeline.encodeprocs", 'encode_procs'),
    "encodeprocs": ("storage.pipeline.encodeprocs", None),
    "ensure_local": ("storage.remote.fill", 'ensure_local'),
    "export": ("storage.archive.portable", 'export'),
    "fdread": ("storage.fs.fdread", None),
    "hostkey": ("storage.fs.hostkey", None),
    "import_": ("storage.archive.portable", 'import_'),
    "isolated": ("storage.fs.isolated", None),
    "list_remotes": ("storage.remote.config", 'list_remotes'),
    "remote_config": ("storage.remote.client", 'remote_config'),
    "DEFAULT_DEADLINE_S": ("storage.remote.backend", 'DEFAULT_DEADLINE_S'),
    "lock_status": ("storage.repo.locks", 'lock_status'),
    "migrate": ("storage.maintenance.migrate", 'migrate'),
    "numa_nodes": ("storage.gpu.device", 'numa_nodes'),
    "own_dir": ("storage.fs.owndir", 'own_dir'),
    "parse_created": ("storage.maintenance.retention", 'parse_created'),
    "path_in": ("storage.format.storedir", 'path_in'),
    "pause_at": ("storage.base.pausepoint", 'pause_at'),
    "plan_runs": ("storage.repo.readstage", 'plan_runs'),
    "pull": ("storage.remote.fill", 'pull'),
    "put": ("storage.pipeline.put", None),
    "read_ahead": ("storage.repo.readstage", 'read_ahead'),
    "read_chunks": ("storage.repo.readstage", 'read_chunks'),
    "read_runs": ("storage.repo.readstage", 'read_runs'),
    "read_summary": ("storage.maintenance.summary", 'read_summary'),
    "find_latest": ("storage.maintenance.summary", 'find_latest'),
    "readstage": ("storage.repo.readstage", None),
    "reflog": ("storage.repo.reflog", None),
    "remote_exists": ("storage.remote.config", 'remote_exists'),
    "remove_remote": ("storage.remote.config", 'remove_remote'),
    "repair": ("storage.maintenance.repair", 'repair'),
    "retag": ("storage.repo.tagging", 'retag'),
    "setting": ("storage.base.settings", 'setting'),
    "settings": ("storage.base.settings", None),
    "shufflelib": ("storage.codecs.shufflelib", None),
    "switch": ("storage.base.settings", 'switch'),
    "tool_version": ("storage.format.manifest", 'tool_version'),
    "validate_remote_name": ("storage.remote.config", 'validate_remote_name'),
    "validate_snapshot_name": ("storage.base.names", 'validate_snapshot_name'),
    "validate_stream_name": ("storage.base.names", 'validate_stream_name'),
    "validate_tag": ("storage.format.manifest", 'validate_tag'),
    "waits": ("storage.base.waits", None),
    "wanted": ("storage.base.wakeprobe", 'wanted'),
    "zstdlib": ("storage.codecs.zstdlib", None),
}

if TYPE_CHECKING:
    from storage.fs.directio import AlignedBuffer as AlignedBuffer
    from storage.remote.fill import ArrivingSource as ArrivingSource
    from storage.fs.directio import BufferPool as BufferPool
    from storage.repo.childreads import ChildReads as ChildReads
    from storage.format.chunkfile import ChunkError as ChunkError
    from storage.format.chunkfile import ChunkHeader as ChunkHeader
    from storage.format.manifest import ChunkRef as ChunkRef
    from storage.codecs.registry import CodecError as CodecError
    from storage.gpu.device import CudaDevice as CudaDevice
    from storage.base.limits import DEFAULT_JOBS as DEFAULT_JOBS
    from storage.base.errors import DamageError as DamageError
    from storage.repo.damage import DamageMarks as DamageMarks
    from storage.repo.store import DamagedCopy as DamagedCopy
    from storage.base.errors import EXIT_DAMAGED as EXIT_DAMAGED
    from storage.base.errors import EXIT_FAILED as EXIT_FAILED
    from storage.base.errors import EXIT_OK as EXIT_OK
    from storage.base.errors import EXIT_RECOVER as EXIT_RECOVER
    from storage.base.errors import EXIT_UNAVAILABLE as EXIT_UNAVAILABLE
    from storage.base.errors import EXIT_USAGE as EXIT_USAGE
    from storage.pipeline.encodeprocs import EncodeProcsError as EncodeProcsError
    from storage.maintenance.retention import Entry as Entry
    from storage.archive.filetree import FileTreeSink as FileTreeSink
    from storage.archive.filetree import FileTreeSource as FileTreeSource
    from storage.archive.files_cache import FilesCache as FilesCache
    from storage.archive.follow import FollowedDirSource as FollowedDirSource
    from storage.pipeline.gpu_engine import GpuEngine as GpuEngine
    from storage.base.errors import GpusnapError as GpusnapError
    from storage.base.names import InvalidNameError as InvalidNameError
    from storage.format.storedir import JOURNAL as JOURNAL
    from storage.format.storedir import LOGS as LOGS
    from storage.format.packs import Loc as Loc
    from storage.format.storedir import MARKER as MARKER
    from storage.format.manifest import Manifest as Manifest
    from storage.repo.readstage import PackSource as PackSource
    from storage.tiers.memory import PinnedPool as PinnedPool
    from storage.tiers.warm import WarmTier as WarmTier
    from storage.repo.warmread import WarmError as WarmError
    from storage.pipeline.put import PipelineError as PipelineError
    from storage.maintenance.retention import Policy as Policy
    from storage.repo.store import Problem as Problem
    from storage.fs import hostkey as hostkey
    from storage.fs.owner import ProcessOwner as ProcessOwner
    from storage.base.progress import Progress as Progress
    from storage.repo.readstage import READERS as READERS
    from storage.archive.filetree import RangeReader as RangeReader
    from storage.fs.directio import Recycler as Recycler
    from storage.pipeline.gpu_engine import Region as Region
    from storage.remote.client import Remote as Remote
    from storage.remote.config import RemoteConfig as RemoteConfig
    from storage.remote.client import RemoteDamageError as RemoteDamageError
    from storage.remote.client import RemoteError as RemoteError
    from storage.remote.fill import RemoteFill as RemoteFill
    from storage.format.storedir import SNAPSHOTS as SNAPSHOTS
    from storage.base.settings import SettingError as SettingError
    from storage.repo.store import SnapshotStore as SnapshotStore
    from storage.pipeline.put import Stages as Stages
    from storage.repo.store import StoreError as StoreError
    from storage.format.manifest import Stream as Stream
    from storage.pipeline.put import StreamSpec as StreamSpec
    from storage.pipeline.put import StreamWriter as StreamWriter
    from storage.base.errors import UnavailableError as UnavailableError
    from storage.base.wakeprobe import WakeProbe as WakeProbe
    from storage.repo.readstage import Want as Want
    from storage.remote.config import add_remote as add_remote
    from storage.fs.directio import address_of as address_of
    from storage.base.settings import apply_switch_interval as apply_switch_interval
    from storage.repo.locks import break_locks as break_locks
    from storage.archive.portable import cat as cat
    from storage.format.manifest import check_tree as check_tree
    from storage.maintenance.gc import collect as collect
    from storage.maintenance.retention import companion_parent as companion_parent
    from storage.maintenance.stats import compute as compute
    from storage.fs.directio import copy_into as copy_into
    from storage.maintenance.retention import decide as decide
    from storage.codecs.registry import decode_host as decode_host
    from storage.codecs.registry import decode_host_into as decode_host_into
    from storage.repo.store import default_store_path as default_store_path
    from storage.codecs import delta as delta
    from storage.maintenance.stats import diff as diff
    from storage.pipeline.encodeprocs import encode_procs as encode_procs
    from storage.pipeline import encodeprocs as encodeprocs
    from storage.remote.fill import ensure_local as ensure_local
    from storage.archive.portable import export as export
    from storage.fs import fdread as fdread
    from storage.archive.portable import import_ as import_
    from storage.fs import isolated as isolated
    from storage.remote.config import list_remotes as list_remotes
    from storage.remote.client import remote_config as remote_config
    from storage.remote.backend import DEFAULT_DEADLINE_S as DEFAULT_DEADLINE_S
    from storage.repo.locks import lock_status as lock_status
    from storage.maintenance.migrate import migrate as migrate
    from storage.gpu.device import numa_nodes as numa_nodes
    from storage.fs.owndir import own_dir as own_dir
    from storage.maintenance.retention import parse_created as parse_created
    from storage.maintenance.retention import Duration as Duration
    from storage.format.storedir import path_in as path_in
    from storage.base.pausepoint import pause_at as pause_at
    from storage.repo.readstage import plan_runs as plan_runs
    from storage.remote.fill import pull as pull
    from storage.pipeline import put as put
    from storage.repo.readstage import read_ahead as read_ahead
    from storage.repo.readstage import read_chunks as read_chunks
    from storage.repo.readstage import read_runs as read_runs
    from storage.maintenance.summary import read_summary as read_summary
    from storage.maintenance.summary import find_latest as find_latest
    from storage.repo import readstage as readstage
    from storage.repo import reflog as reflog
    from storage.remote.config import remote_exists as remote_exists
    from storage.remote.config import remove_remote as remove_remote
    from storage.maintenance.repair import repair as repair
    from storage.repo.tagging import retag as retag
    from storage.base.settings import setting as setting
    from storage.base import settings as settings
    from storage.codecs import shufflelib as shufflelib
    from storage.base.settings import switch as switch
    from storage.format.manifest import tool_version as tool_version
    from storage.remote.config import validate_remote_name as validate_remote_name
    from storage.base.names import validate_snapshot_name as validate_snapshot_name
    from storage.base.names import validate_stream_name as validate_stream_name
    from storage.format.manifest import validate_tag as validate_tag
    from storage.base import waits as waits
    from storage.base.wakeprobe import wanted as wanted
    from storage.codecs import zstdlib as zstdlib

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'storage.api' has no attribute {name!r}") from None
    value = importlib.import_module(module) if attr is None else getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

"""``ftbridge-ckpt``: list, inspect and verify replica-group checkpoints.

::

    ftbridge-ckpt list DIR            # one line per checkpoint (no hashing)
    ftbridge-ckpt inspect DIR [TAG]   # metadata and files of TAG (default: latest)
    ftbridge-ckpt verify DIR [TAG]    # re-hash every file, then scan each .pt with the safe loader

Exit codes: 0 fine; 1 ``verify`` found a bad checkpoint; 2 bad usage, no such folder, nothing to show,
or metadata/manifest that ``list`` or ``inspect`` cannot read (one-line message, no traceback).
Every read is bounded and refuses links, FIFOs and devices; no pickle code runs (``verify`` loads
with :mod:`ftbridge.checkpoint.safe_load` once the hashes match; ``list`` and ``inspect`` import no
torch). ``--key-file`` (default ``$FTBRIDGE_CKPT_KEY_FILE``) checks every manifest's HMAC too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.store import CheckpointInfo, CheckpointStore, load_key
from ftbridge.launch.cli_types import ArgumentParser


def _pick(store: CheckpointStore, tag: Optional[str]) -> Optional[CheckpointInfo]:
    found = store.list()
    if tag is None:
        tag = mf.read_latest(store.root) or (found[-1].tag if found else None)
    return next((c for c in found if c.tag == tag), None)


def _size(ckpt: CheckpointInfo) -> int:
    try:
        return int(mf.read_manifest(ckpt.path)["total_bytes"])
    except (OSError, ValueError, KeyError):
        return sum(os.lstat(os.path.join(ckpt.path, n)).st_size for n in os.listdir(ckpt.path))


def cmd_list(store: CheckpointStore) -> int:
    found = store.list()
    if not found:
        print(f"no checkpoints in {store.root}", file=sys.stderr)
        return 2
    latest = mf.read_latest(store.root)
    unreadable = 0
    print(f"{'tag':<20} {'step':>7} {'group':>5} {'stage':>5} {'bytes':>12} {'quorum':>6} {'repl':>4}  saved_at")
    for c in found:
        try:
            m = c.metadata()
            q = m.get("quorum", {})
            row = (f"{m['group_size']:>5} {m['zero_stage']:>5} {_size(c):>12} {str(q.get('quorum_id', '?')):>6} "
                   f"{str(q.get('participants', '?')):>4}  {m.get('saved_at', '?')}")
        except (OSError, ValueError) as e:
            row = f"unreadable metadata ({e})"
            unreadable += 1
        mark = "*" if c.tag == latest else " "
        print(f"{c.tag + mark:<20} {c.step:>7} {row}")
    print("(* latest; repl: replica groups in the quorum at save time)")
    return 2 if unreadable else 0


def cmd_inspect(store: CheckpointStore, tag: Optional[str]) -> int:
    ckpt = _pick(store, tag)
    if ckpt is None:
        print(f"no checkpoint {tag or 'latest'} in {store.root}", file=sys.stderr)
        return 2
    try:
        meta = ckpt.metadata()
        files = mf.read_manifest(ckpt.path, store.key)["files"]
    except (OSError, ValueError) as e:
        print(f"{ckpt.path}: unreadable metadata or manifest ({e})", file=sys.stderr)
        return 2
    q = meta.get("quorum", {})
    print(f"checkpoint   {ckpt.path}")
    print(f"step         {meta['step']}")
    print(f"group size   {meta['group_size']} ranks (loads into any number of groups of this size)")
    print(f"ZeRO stage   {meta['zero_stage']}")
    print(f"dtypes       {meta.get('dtypes')}")
    print(f"size         {_size(ckpt)} bytes")
    print(f"quorum       id {q.get('quorum_id')}, {q.get('participants')} replica groups, written by replica "
          f"group {q.get('replica_group_id')} (replica rank {q.get('replica_rank')})")
    print(f"saved at     {meta.get('saved_at')}")
    print(f"versions     {meta.get('versions')}")
    print(json.dumps({k: meta[k] for k in ("manager", "engine_counters", "data_position") if k in meta}, indent=1))
    for name, f in sorted(files.items()):
        print(f"  {f['bytes']:>12}  {f['sha256'][:16]}  {name}")
    return 0


def _unsafe_files(ckpt: CheckpointInfo) -> List[str]:
    """Load every ``.pt`` of a hash-verified checkpoint with the safe loader; the refusals (imports torch)."""
    from ftbridge.checkpoint.safe_load import UnsafeCheckpointError, check_files  # torch: verify only

    problems = []
    for path in mf.checkpoint_files(ckpt.path):
        try:
            check_files([path])
        except UnsafeCheckpointError as e:
            problems.append(str(e))
    return problems


def cmd_verify(store: CheckpointStore, tag: Optional[str]) -> int:
    targets = store.list() if tag is None else [c for c in store.list() if c.tag == tag]
    if not targets:
        print(f"no checkpoint {tag + ' ' if tag else ''}in {store.root}", file=sys.stderr)
        return 2
    bad = 0
    for c in targets:
        problems = c.problems() or _unsafe_files(c)
        print(f"{c.tag}: {'OK' if not problems else 'BAD'}")
        for p in problems:
            print(f"  {p}")
        bad += bool(problems)
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ftbridge-ckpt``: one subcommand per action (``list``, ``inspect``, ``verify``)."""
    p = ArgumentParser(prog="ftbridge-ckpt", description="List, inspect and verify ftbridge checkpoints.")
    p.add_argument("--key-file", default=os.environ.get("FTBRIDGE_CKPT_KEY_FILE"),
                   help="checkpoint key: check every manifest's HMAC (default $FTBRIDGE_CKPT_KEY_FILE)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="one line per checkpoint").add_argument("dir")
    for name, text in (("inspect", "metadata and files"), ("verify", "re-hash against the manifest")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("dir")
        sp.add_argument("tag", nargs="?", default=None, help="e.g. global_step100 (inspect: default latest; "
                                                             "verify: default all)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``ftbridge-ckpt``; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.dir):
        what = "no such folder" if not os.path.lexists(args.dir) else "not a folder"
        print(f"ftbridge-ckpt: {args.dir}: {what}", file=sys.stderr)
        return 2
    try:
        store = CheckpointStore(args.dir, load_key(args.key_file, args.dir))
        if args.cmd == "list":
            return cmd_list(store)
        if args.cmd == "inspect":
            return cmd_inspect(store, args.tag)
        return cmd_verify(store, args.tag)
    except (OSError, ValueError) as e:  # anything the checks above did not name: a message, not a traceback
        print(f"ftbridge-ckpt: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

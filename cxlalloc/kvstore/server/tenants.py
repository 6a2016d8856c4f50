"""Tenants of a kv-server: who a connection is, decided by its credentials.

A tenant is named by the operator (``--tenant NAME:USERS[:SIZE]``) and bound
to the peer credentials of the connecting process (``SO_PEERCRED``: its uid,
or its gid for ``@group``), never to anything the client sends.  Each tenant
has a pool of its own (its own sealed memfd, its own index and quotas: a
:class:`~cxlalloc.kvstore.server.state.ServerState` each), so a client maps
only its tenant's memory, and no other tenant's blocks can evict its blocks.
Its block names (:func:`~cxlalloc.kvstore.keys.namespaced_keys` with
``tenant=``) and so its Redis keys and their MACs include the tenant's name.

Without ``--tenant`` the server has one tenant, ``""`` (the single-tenant
deployment of before: every process that may open the socket shares one pool).

The operator (root, or the server's own uid) is not a tenant unless named in
one: it may ask for ``stats`` of every tenant, and may not map a pool.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from cxlalloc.config import format_bytes, parse_size
from cxlalloc.kvstore.keys import TENANT_NAME

DEFAULT_TENANT = ""           # the single tenant of a server without --tenant


@dataclass
class TenantSpec:
    """One ``--tenant``: its name, the uids and gids bound to it, its pool bytes (None: a share of the rest)."""

    name: str
    uids: List[int] = field(default_factory=list)
    gids: List[int] = field(default_factory=list)
    size: Optional[int] = None


FORM = ("NAME:USERS[:SIZE] (NAME: 1-64 of A-Z a-z 0-9 _ . -; USERS: comma list of user names or uids and "
        "@group names or @gids; SIZE: the tenant's pool, a positive size such as 8GiB, at least one page; "
        "e.g. --tenant team-a:alice,@inference:64GiB)")
MAX_ID = (1 << 32) - 2  # uid_t/gid_t; 2**32 - 1 is (uid_t)-1, "no id"


def _id(text: str, kind: str, names, spec_text: str) -> int:
    if text.isdigit():
        n = int(text)
        if n > MAX_ID:
            raise ValueError(f"cxlalloc option '--tenant': {spec_text!r}: USERS has {kind} id {text}, out of "
                             f"range; allowed: 0..{MAX_ID}; the form: {FORM}")
        return n
    try:
        return names(text)
    except KeyError:
        raise ValueError(f"cxlalloc option '--tenant': {spec_text!r}: USERS names no {kind} {text!r} on this "
                         f"machine; allowed: {kind} names of this machine or numeric ids; the form: {FORM}") from None


def _uid(user: str, spec_text: str = "") -> int:
    return _id(user, "user", lambda n: pwd.getpwnam(n).pw_uid, spec_text or user)


def _gid(group: str, spec_text: str = "") -> int:
    return _id(group, "group", lambda n: grp.getgrnam(n).gr_gid, spec_text or "@" + group)


def parse_tenant(text: str) -> TenantSpec:
    """``NAME:USERS[:SIZE]`` -> :class:`TenantSpec`.

    USERS is a comma list of user names or uids, and ``@group`` names or
    ``@gid``; SIZE its pool bytes (``8GiB``, more than 0).  NAME is 1-64
    characters of ``A-Z a-z 0-9 _ . -``.

    Raises:
        ValueError: naming ``--tenant``, the value, the field at fault (NAME, USERS or SIZE), its allowed
            values and the form expected.
    """
    parts = str(text).split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"cxlalloc option '--tenant': {text!r} has {len(parts)} field(s); allowed: 2 or 3, "
                         f"the form: {FORM}")
    if not TENANT_NAME.match(parts[0]):
        raise ValueError(f"cxlalloc option '--tenant': {text!r}: NAME {parts[0]!r} is not allowed; allowed: 1-64 "
                         f"of A-Z a-z 0-9 _ . -; the form: {FORM}")
    if not parts[1].strip():
        raise ValueError(f"cxlalloc option '--tenant': {text!r}: USERS is empty; the form: {FORM}")
    spec = TenantSpec(parts[0])
    for who in parts[1].split(","):
        who = who.strip()
        if not who or who == "@":
            raise ValueError(f"cxlalloc option '--tenant': {text!r} has an empty user in USERS; the form: {FORM}")
        if who.startswith("@"):
            spec.gids.append(_gid(who[1:], text))
        else:
            spec.uids.append(_uid(who, text))
    if len(parts) == 3:
        try:
            size = parse_size(parts[2].strip(), "--tenant")
        except ValueError:
            size = -1
        if size <= 0:
            raise ValueError(f"cxlalloc option '--tenant': {text!r}: SIZE {parts[2]!r} is not allowed; allowed: a "
                             f"positive size such as 512MiB or 8GiB (at least one page), or no SIZE for an equal "
                             f"share of --size; the form: {FORM}")
        spec.size = size
    return spec


def split_sizes(specs: Sequence[TenantSpec], total: int, page: int) -> Dict[str, int]:
    """Each tenant's pool bytes: its own SIZE, or an equal share (page multiple)
    of what ``total`` (``--size``) leaves.

    Raises:
        ValueError: the named sizes exceed ``--size``, or a share is under one page.
    """
    for s in specs:
        if s.size is not None and s.size < page:
            raise ValueError(f"cxlalloc option '--tenant': tenant {s.name!r} has SIZE {format_bytes(s.size)}, under "
                             f"one page of the pool ({format_bytes(page)}); allowed: at least {format_bytes(page)}")
    named = sum(s.size for s in specs if s.size is not None)
    rest = [s for s in specs if s.size is None]
    if named > total:
        raise ValueError(f"cxlalloc option '--tenant': the tenants' sizes add up to {format_bytes(named)}, more than "
                         f"--size {format_bytes(total)}")
    share = (total - named) // len(rest) // page * page if rest else 0
    if rest and share < page:
        raise ValueError(f"cxlalloc option '--tenant': --size {format_bytes(total)} leaves {format_bytes(share)} to "
                         f"each of {', '.join(s.name for s in rest)}; give them sizes or raise --size")
    return {s.name: s.size if s.size is not None else share for s in specs}


class Tenancy:
    """Which tenant a peer credential belongs to.

    Args:
        specs: the ``--tenant`` options (none: one tenant ``""`` for everyone).
        operator_uid: the server's uid (it and root are the operator).

    Raises:
        ValueError: a name given twice, or a uid/gid bound to two tenants (``--tenant``).
    """

    def __init__(self, specs: Sequence[TenantSpec] = (), operator_uid: Optional[int] = None):
        self.specs = list(specs)
        self.operator_uid = os.geteuid() if operator_uid is None else int(operator_uid)
        self.by_uid: Dict[int, str] = {}
        self.by_gid: Dict[int, str] = {}
        names = set()
        for s in self.specs:
            if s.name in names:
                raise ValueError(f"cxlalloc option '--tenant': the tenant {s.name!r} is named twice")
            names.add(s.name)
            for table, ids, what in ((self.by_uid, s.uids, "uid"), (self.by_gid, s.gids, "gid")):
                for i in ids:
                    if table.get(i, s.name) != s.name:
                        raise ValueError(f"cxlalloc option '--tenant': {what} {i} is bound to two tenants "
                                         f"({table[i]!r} and {s.name!r})")
                    table[i] = s.name

    @property
    def multi(self) -> bool:
        """True when tenants were named (else one tenant ``""``)."""
        return bool(self.specs)

    def names(self) -> List[str]:
        return [s.name for s in self.specs] if self.specs else [DEFAULT_TENANT]

    def is_operator(self, uid: int) -> bool:
        """Root or the server's own uid."""
        return uid == 0 or uid == self.operator_uid

    def resolve(self, uid: int, gid: int) -> Optional[str]:
        """The tenant of a peer with ``uid``/``gid`` (its uid's binding first,
        then its primary gid's); None when it has none (single-tenant: always ``""``)."""
        if not self.specs:
            return DEFAULT_TENANT
        if uid in self.by_uid:
            return self.by_uid[uid]
        return self.by_gid.get(gid)

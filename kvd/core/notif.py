"""The NIXL notification a reader's READ carries to the holder: one codec, both sides.

The tag is ``kvd2|<lease>|<admission>``: the holder hands it to the reader in PreparePull, or,
for a READ posted beside its admission, the reader builds it from the read id it asks to be
admitted under (:func:`valid_read_id`). The reader appends which part of how many parts the READ
is and its bytes. The holder's notification
handler decodes it to count the admitted read's parts. Anything else (another program's
notification, a malformed or truncated one) decodes to None and is ignored.

A **step's READ** (:mod:`kvd.core.step_reads`: the READs of several pulls from one holder engine,
asked in one turn of the reader's event loop, posted as one NIXL transfer) carries one
notification naming every read it holds: ``kvd3|<count>`` then, per read, ``<lease>|<admission>|
<part>|<parts>|<bytes>`` (:func:`encode_many`). Only a holder that says it decodes them
(``EngineDescriptor.step_notifications``) is sent one; :func:`decode_all` reads both forms, and
bounds the second (at most :data:`MAX_READS_PER_NOTIFICATION` reads, every field checked as a
lone notification's) so a hostile or stale notification cannot make the holder do more work than
a step's worth.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

PREFIX = "kvd2"
STEP_PREFIX = "kvd3"
_MAX_LEN = 512
MAX_READS_PER_NOTIFICATION = 64
"""Reads one step notification may name: the most READs the reader posts in one worker call."""
_MAX_STEP_LEN = MAX_READS_PER_NOTIFICATION * _MAX_LEN
READ_ID_MAX = 64
_READ_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{READ_ID_MAX}}}")


@dataclasses.dataclass(frozen=True)
class ReadNotification:
    lease_id: str
    admission_id: str
    part: int
    parts: int
    nbytes: int


def tag(lease_id: str, admission_id: str) -> str:
    """The holder's part of the notification (PreparePullResponse.notif_tag)."""
    for field in (lease_id, admission_id):
        if not field or "|" in field:
            raise ValueError(f"notification field {field!r} is empty or holds '|'")
    return f"{PREFIX}|{lease_id}|{admission_id}"


def valid_read_id(read_id: str) -> bool:
    """Whether a reader-chosen admission id fits a notification: 1-64 of ``[A-Za-z0-9._-]``."""
    return _READ_ID.fullmatch(read_id) is not None


def encode(notif_tag: str, part: int, parts: int, nbytes: int) -> bytes:
    """The full notification of READ ``part`` of ``parts`` (the reader's side)."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} is not a part")
    return f"{notif_tag}|{part}|{parts}|{nbytes}".encode()


def _read(lease_id: str, admission_id: str, part: int, parts: int, nbytes: int) -> ReadNotification | None:
    """The read these fields name, or None where any is not one (every form's one check)."""
    if not lease_id or not admission_id or not 0 <= part < parts or nbytes < 0:
        return None
    return ReadNotification(lease_id, admission_id, part, parts, nbytes)


def _numbers(part: str, parts: str, nbytes: str) -> tuple[int, int, int] | None:
    try:
        return int(part), int(parts), int(nbytes)
    except ValueError:
        return None


def read_of(notif_tag: str, part: int, parts: int, nbytes: int) -> ReadNotification | None:
    """What :func:`decode` makes of ``encode(notif_tag, part, parts, nbytes)``, without the bytes
    (a step READ names each of its reads: the reader builds them per pull); None where decode
    would refuse it (a tag that is not a holder's)."""
    fields = notif_tag.split("|")
    if len(fields) != 3 or fields[0] != PREFIX or len(notif_tag) + len(f"|{part}|{parts}|{nbytes}") > _MAX_LEN:
        return None
    return _read(fields[1], fields[2], part, parts, nbytes)


def decode(message: bytes) -> ReadNotification | None:
    if len(message) > _MAX_LEN:
        return None
    fields = message.decode(errors="replace").split("|")
    if len(fields) != 6 or fields[0] != PREFIX:
        return None
    numbers = _numbers(*fields[3:])
    return None if numbers is None else _read(fields[1], fields[2], *numbers)


def encode_many(reads: Sequence[ReadNotification]) -> bytes:
    """The notification of a step's READ: every read it holds, each with its own part and bytes
    (the reader's side; one read is encoded as a lone notification, as :func:`encode` would)."""
    if not 1 <= len(reads) <= MAX_READS_PER_NOTIFICATION:
        raise ValueError(f"a step notification names 1-{MAX_READS_PER_NOTIFICATION} reads, not {len(reads)}")
    if len(reads) == 1:
        read = reads[0]
        return encode(tag(read.lease_id, read.admission_id), read.part, read.parts, read.nbytes)
    fields = [STEP_PREFIX, str(len(reads))]
    for read in reads:
        tag(read.lease_id, read.admission_id)  # the same checks as a lone notification's
        if not 0 <= read.part < read.parts:
            raise ValueError(f"part {read.part} of {read.parts} is not a part")
        fields += [read.lease_id, read.admission_id, str(read.part), str(read.parts), str(read.nbytes)]
    return "|".join(fields).encode()


def decode_all(message: bytes) -> list[ReadNotification]:
    """Every read a notification names: one for a lone READ's (:func:`decode`), each read of a
    step's READ's (:func:`encode_many`), none for anything else (the whole message is then
    ignored: a step notification with one bad read proves nothing of the others)."""
    if not message.startswith(STEP_PREFIX.encode()):
        read = decode(message)
        return [] if read is None else [read]
    if len(message) > _MAX_STEP_LEN:
        return []
    fields = message.decode(errors="replace").split("|")
    try:
        count = int(fields[1]) if len(fields) > 1 else 0
    except ValueError:
        return []
    if not 2 <= count <= MAX_READS_PER_NOTIFICATION or len(fields) != 2 + 5 * count or fields[0] != STEP_PREFIX:
        return []
    reads = []
    for start in range(2, len(fields), 5):
        lease_id, admission_id, part_s, parts_s, nbytes_s = fields[start : start + 5]
        numbers = _numbers(part_s, parts_s, nbytes_s)
        read = None if numbers is None else _read(lease_id, admission_id, *numbers)
        if read is None:
            return []
        reads.append(read)
    return reads

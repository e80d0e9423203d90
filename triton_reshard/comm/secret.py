"""The job's secret: where a refit group's members find it, how it is checked, and the key the handshake of
:mod:`~triton_reshard.comm.auth` proves (the secret, or a public constant on loopback / with an explicit
insecure opt-in). Nothing here touches the network except :func:`is_loopback`'s name lookup."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import warnings
from dataclasses import dataclass, field

SECRET_ENV = "TRITON_RESHARD_SECRET"
SECRET_FILE_ENV = "TRITON_RESHARD_SECRET_FILE"
INSECURE_ENV = "TRITON_RESHARD_INSECURE"
MIN_SECRET_BYTES = 16
NO_SECRET_KEY = b"triton_reshard/v1/no-secret"  # the key without a secret: loopback or insecure=True only


@dataclass(frozen=True)
class ResolvedSecret:
    """A secret already looked up and checked (a plug-in's, ``integrations.engine.plugin_secret``): :func:`resolve_secret` hands its
    ``value`` back as it is, so the group uses it without looking anything up again. ``value`` None means
    looked up and found nowhere (the loopback rule applies). The repr never shows the secret."""

    value: bytes | None = field(repr=False)


def resolve_secret(secret: bytes | str | ResolvedSecret | None = None, *, env: str = SECRET_ENV,
                   file_env: str = SECRET_FILE_ENV, where: str = "init_refit_group") -> bytes | None:
    """The secret as bytes: ``secret`` itself, else the environment variable ``env`` (the secret), else
    ``file_env`` (a path to a file holding it; trailing whitespace stripped); ``None`` when none is set.
    An empty or short secret (under :data:`MIN_SECRET_BYTES` bytes) is refused: it would be guessed.
    A :class:`ResolvedSecret` was resolved before: its value, as it is."""
    if isinstance(secret, ResolvedSecret):
        return secret.value
    origin = "secret="
    if secret is None:
        if os.environ.get(env) is not None and os.environ.get(file_env) is not None:
            raise ValueError(f"{where}: both {env} and {file_env} are set: set one")
        if os.environ.get(file_env) is not None:
            secret, origin = read_secret_file(os.environ[file_env], where=where), f"{file_env}"
        elif os.environ.get(env) is not None:
            secret, origin = os.environ[env], env
        else:
            return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    elif isinstance(secret, (bytes, bytearray, memoryview)):
        secret = bytes(secret)
    else:
        raise TypeError(f"{where}: the secret must be bytes or str, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: the secret ({origin}) is {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES} random bytes (e.g. `python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'`)")
    return secret


def secret_from(env: str | None = SECRET_ENV, file: str | os.PathLike | None = None, *,
                where: str = "init_refit_group") -> bytes | None:
    """The secret a plug-in's config points at without holding it: the file ``file`` if given, else the
    environment variable named ``env`` if it is set; ``None`` when neither is (then the group's own default
    applies: :func:`resolve_secret`'s environment variables, or loopback only). Checked like
    :func:`resolve_secret`."""
    if file is not None:
        return resolve_secret(read_secret_file(file, where=where), where=f"{where} (secret file {os.fspath(file)!r})")
    if env is not None and os.environ.get(env) is not None:
        return resolve_secret(os.environ[env], where=f"{where} (environment variable {env})")
    return None


def read_secret_file(path: str | os.PathLike, *, where: str = "init_refit_group") -> bytes:
    """The secret held in the file ``path`` (trailing whitespace and newline stripped). A file that every user
    of the machine may write is refused (any of them could put a secret of their own there and join); one
    they may all read draws a warning (a Kubernetes secret volume is 0644 unless ``defaultMode`` says 0400)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"{where}: cannot read the secret file {os.fspath(path)!r}: {e.strerror}") from None
    if mode & stat.S_IWOTH:
        raise ValueError(f"{where}: the secret file {os.fspath(path)!r} is writable by every user of this machine "
                         f"(mode {stat.S_IMODE(mode):04o}); make it 0600 (chmod 600)")
    if mode & stat.S_IROTH:
        warnings.warn(f"{where}: the secret file {os.fspath(path)!r} is readable by every user of this machine "
                      f"(mode {stat.S_IMODE(mode):04o}); make it 0600 (chmod 600)", UserWarning, stacklevel=3)
    return data.rstrip()


def is_loopback(host: str) -> bool:
    """``host`` names this machine only: 127.0.0.0/8, ::1, or a name all of whose addresses are loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addrs = {i[4][0] for i in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def insecure_opt_in(insecure: bool | None) -> bool:
    """``insecure`` if given, else whether the environment says ``TRITON_RESHARD_INSECURE=1``."""
    if insecure is not None:
        if not isinstance(insecure, bool):
            raise TypeError(f"insecure must be a bool or None, got {insecure!r}")
        return insecure
    return os.environ.get(INSECURE_ENV, "") == "1"


def group_key(host: str, secret: bytes | None, insecure: bool | None, *, where: str) -> bytes:
    """The key the handshake proves: the secret; without one, a public constant, allowed on loopback hosts
    (only processes of this machine reach them) or with an explicit insecure opt-in."""
    if secret is not None:
        return secret
    if is_loopback(host) or insecure_opt_in(insecure):
        return NO_SECRET_KEY
    raise ValueError(
        f"{where}: {host!r} is not a loopback address and no secret is set: any process that reaches the port "
        f"could join the group, read the layouts and send or receive weights. Pass secret= or set "
        f"{SECRET_ENV} / {SECRET_FILE_ENV} on every member (the same secret), or opt out explicitly with "
        f"insecure=True / {INSECURE_ENV}=1")

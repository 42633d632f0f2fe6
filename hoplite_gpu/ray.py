"""hoplite-gpu inside a Ray cluster.

``hoplite_gpu.ray.start_directory()`` (on the driver) starts the directory as a
named Ray actor; ``hoplite_gpu.ray.join()`` (in any task or actor, sync or async,
also in one that Ray restarted) finds it by name and joins as a node. ObjectIDs
pickle, so they travel in task arguments and return values.

On one machine the defaults bind everything to loopback. On a multi-node Ray
cluster pass ``host="0.0.0.0"`` to `start_directory` and set
``HOPLITE_NODE_HOST=0.0.0.0`` for the workers (each node then advertises the
address that routes to the directory).

``start_directory(standbys=k)`` also starts k standby directory actors (named
``<name>-standby-<i>``) with the same token; `join` gives nodes every
address, and when the directory in use is gone they move to the next.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import ray

from . import api
from .auth import new_token
from .config import TLS_SETTINGS, Config, check_timeout
from .directory.server import DirectoryServer
from .errors import DirectoryUnavailable, InvalidArgument, NotInitialized
from .tls import load as load_tls

DEFAULT_NAME = "hoplite-directory"
#: The most standby directories a group may have (`join` looks each up by name).
MAX_STANDBYS = 4
#: A non-detached actor dies with its last handle: the driver keeps one.
_handles: dict[tuple[str, str], Any] = {}


@ray.remote(num_cpus=0)
class DirectoryActor:
    """Runs the directory's asyncio server on a thread of its own inside the actor."""

    def __init__(self, token: str, host: str, port: int, settings: dict[str, Any]) -> None:
        self._token = token
        #: its TLS files, told to nodes that join naming none of their own
        self._tls: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="hoplite-directory", daemon=True).start()
        config = Config.from_env(**settings)
        self._tls = {name: getattr(config, name) for name in TLS_SETTINGS
                     if getattr(config, name) is not None}
        self._server = DirectoryServer(token, host=host, port=port, tls=load_tls(config),
                                       **config.directory_settings())
        self._address = asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(30)
        #: every directory of this one's group, comma-separated (`set_roster`)
        self._roster = ""
        if host in ("0.0.0.0", "::"):
            # The address that routes here, in the scheme the directory serves
            # (nodes dial that scheme: a UCX directory announced as tcp:// is
            # dialled over TCP and never answers).
            ip = ray.util.get_node_ip_address()
            scheme, _, rest = self._address.rpartition("://")
            where = f"[{ip}]" if ":" in ip else ip
            self._address = f"{scheme or 'tcp'}://{where}:{rest.rpartition(':')[2]}"

    def info(self) -> dict[str, str]:
        """What a node joins with: the group's addresses (this one's alone
        when it has no standbys), the token, and the TLS files, if any."""
        return {"address": self._roster or self._address, "token": self._token, **self._tls}

    def set_roster(self, addresses: str) -> None:
        """The addresses of this directory's group, in the order nodes try them."""
        self._roster = addresses

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(30)


def start_directory(*, name: str = DEFAULT_NAME, namespace: str | None = None,
                    host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                    detached: bool = False, actor_options: dict[str, Any] | None = None,
                    standbys: int = 0, **settings: Any) -> dict[str, str]:
    """Start the directory actor (or attach to a running one of that name);
    returns its address and token. `actor_options` go to the actor's
    ``.options()``, e.g. ``resources`` or ``scheduling_strategy`` to place the
    directory on a chosen node of a multi-node cluster.

    `standbys` (at most MAX_STANDBYS) more directory actors start with it,
    named ``<name>-standby-<i>``, on `host` (any free port), with its token
    and `actor_options`; the address returned, and the one `join` gives
    nodes, lists them all, the first first. A group of which any member
    still answers is attached to as it is: a dead member is not replaced
    (nodes that moved to a standby would part from nodes joining a new
    first); once none answers, the group starts anew."""
    _check_name(name, namespace)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be an int in [0, 65535] (0: any free one); got {port!r}")
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"host must be a non-empty str; got {host!r}")
    if isinstance(standbys, bool) or not isinstance(standbys, int) \
            or not 0 <= standbys <= MAX_STANDBYS:
        raise InvalidArgument(f"standbys must be an int in [0, {MAX_STANDBYS}]; got {standbys!r}")
    running = _group_info(name, namespace, time.monotonic() + 60)[0]
    if running is not None:
        return running
    info = _start_one(name, namespace, host, port, token, detached, actor_options, settings)
    if not standbys:
        return info
    members = [_standby_name(name, i) for i in range(1, standbys + 1)]
    try:
        roster = ",".join([info["address"], *(
            _start_one(member, namespace, host, 0, info["token"], detached, actor_options,
                       settings)["address"] for member in members)])
        ray.get([ray.get_actor(member, namespace=namespace).set_roster.remote(roster)
                 for member in [name, *members]], timeout=60)
    except BaseException:
        stop_directory(name=name, namespace=namespace)  # (no half-started group stays)
        raise
    return {**info, "address": roster}


def _start_one(name: str, namespace: str | None, host: str, port: int, token: str | None,
               detached: bool, actor_options: dict[str, Any] | None,
               settings: dict[str, Any]) -> dict[str, str]:
    """Start one directory actor, or attach to a running one of that name."""
    key = _key(name, namespace)
    try:
        actor = ray.get_actor(name, namespace=namespace)  # attach to a running one
        ray.get(actor.info.remote(), timeout=60)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        # A dead (or silent) directory under the name, e.g. its process died:
        # removed, and a new one started in its place.
        ray.kill(actor)
        _handles.pop(key, None)
        actor = None
    except ValueError:
        actor = None
    if actor is None:
        config = Config.from_env(**settings)  # a bad setting: its ConfigError here, not a dead actor
        load_tls(config)  # (and bad TLS files)
        # This process's TLS files (its HOPLITE_TLS_* too): the actor's
        # process may not have our environment.
        settings = {**settings, **{name: getattr(config, name) for name in TLS_SETTINGS}}
        options: dict[str, Any] = {**(actor_options or {}), "name": name, "namespace": namespace,
                                   "get_if_exists": True}
        if detached:
            options["lifetime"] = "detached"
        actor = DirectoryActor.options(**options).remote(token or new_token(), host, port, settings)
        # keep the creating handle: a non-detached actor dies with its owner's handles
        _handles[key] = actor
    try:
        return ray.get(actor.info.remote(), timeout=60)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        # A directory that could not start: remove it, or its name stays taken
        # by a dead actor and every later start or join meets that.
        ray.kill(actor)
        _handles.pop(key, None)
        raise DirectoryUnavailable(f"the directory actor {name!r} did not start: {exc}") from exc


def _check_name(name: object, namespace: object) -> None:
    """Refused here: Ray's own ValueError for an empty name reads as "no such
    actor", and a join would wait out its timeout to say so. And Ray must be
    up: Ray's calls below would start a local Ray of their own, in which no
    directory is found (and the program's own ray.init then fails)."""
    if not ray.is_initialized():
        raise NotInitialized("Ray is not initialised in this process: call ray.init() first "
                             "(hoplite_gpu.ray joins the directory actor of a Ray cluster)")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"name must be a non-empty str; got {name!r}")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise InvalidArgument(f"namespace must be a non-empty str or None; got {namespace!r}")


def _key(name: str, namespace: str | None) -> tuple[str, str]:
    """The driver's handle of a directory actor, by name and namespace (None:
    this job's own namespace, as Ray reads it)."""
    return name, namespace or ray.get_runtime_context().namespace


def _standby_name(name: str, i: int) -> str:
    return f"{name}-standby-{i}"


def _members(name: str, namespace: str | None, standbys: bool) -> list[Any]:
    """The actors of directory group `name` that Ray knows of now: the first
    alone, or (`standbys`) its standbys in order."""
    names = [_standby_name(name, i) for i in range(1, MAX_STANDBYS + 1)] if standbys else [name]
    found = []
    for member in names:
        try:
            found.append(ray.get_actor(member, namespace=namespace))
        except ValueError:
            continue
    return found


def _find(name: str, namespace: str | None, timeout: float) -> list[Any]:
    """Wait until Ray knows of an actor of group `name`: its first (the
    first's name goes with its process), or else a standby. Returns
    `_members` of the first (empty when only a standby is known)."""
    deadline = time.monotonic() + timeout
    while True:
        first = _members(name, namespace, False)
        if first or _members(name, namespace, True):
            return first
        if time.monotonic() > deadline:
            raise DirectoryUnavailable(
                f"no hoplite directory actor named {name!r} in this Ray cluster; "
                "call hoplite_gpu.ray.start_directory() on the driver first")
        time.sleep(0.1)


def _group_info(name: str, namespace: str | None, deadline: float, first: list[Any] | None = None
                ) -> tuple[dict[str, str] | None, BaseException | None]:
    """The `info` of group `name`'s first actor (`first`: as looked up
    already), or else of the first of its standbys that answers by the
    deadline; or None and the last error."""
    error: BaseException | None = None
    for standbys in (False, True):
        for actor in (first if first is not None and not standbys
                      else _members(name, namespace, standbys)):
            try:
                return ray.get(actor.info.remote(),
                               timeout=max(0.0, deadline - time.monotonic())), None
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                error = exc
    return None, error


async def _group_info_async(name: str, namespace: str | None, deadline: float,
                            first: list[Any]) -> tuple[dict[str, str] | None, BaseException | None]:
    """`_group_info` without blocking the caller's event loop."""
    error: BaseException | None = None
    for standbys in (False, True):
        for actor in (first if not standbys
                      else await asyncio.to_thread(_members, name, namespace, standbys)):
            try:
                return await asyncio.wait_for(actor.info.remote(),
                                              max(0.0, deadline - time.monotonic())), None
            except (ray.exceptions.RayActorError, TimeoutError) as exc:
                error = exc
    return None, error


def _unavailable(name: str, exc: BaseException | None) -> DirectoryUnavailable:
    why = "it left" if exc is None else f"{type(exc).__name__}: {exc}"
    return DirectoryUnavailable(f"the directory actor {name!r} did not answer: {why}")


#: Seconds a join waits for the directory actor by default.
_JOIN_TIMEOUT_S = 60.0


def join(*, name: str = DEFAULT_NAME, namespace: str | None = None,
         timeout: float | None = _JOIN_TIMEOUT_S, **settings: Any) -> api.Runtime:
    """Join the cluster of the directory actor `name` as a node (idempotent);
    finding the actor and asking it where the directory listens take at most
    `timeout` seconds together (None: the default)."""
    _check_name(name, namespace)
    timeout = _JOIN_TIMEOUT_S if timeout is None else check_timeout(timeout)
    deadline = time.monotonic() + timeout
    first = _find(name, namespace, timeout)
    info, error = _group_info(name, namespace, deadline, first)
    if info is None:
        raise _unavailable(name, error) from error
    return _adopt(info, settings)


#: Held while a process joins: concurrent joins (an actor with
#: max_concurrency > 1, an async actor's overlapping methods) share one runtime.
_joining = threading.Lock()


def _adopt(info: dict[str, Any], settings: dict[str, Any]) -> api.Runtime:
    """This process's runtime for the directory `info` describes: the current
    one if it is that directory's (same addresses, the standbys' too, and
    token: a directory started again on the same port has a new token), else
    a new one."""
    with _joining:
        current = api._runtime
        if current is not None and not current.closed:
            if (",".join(current.addresses) == info["address"]
                    and current.token == info["token"]):
                return current
            api.shutdown()
        if not any(settings.get(name) or os.environ.get(f"HOPLITE_{name.upper()}")
                   for name in TLS_SETTINGS):
            # (no TLS files of its own: the directory's, which a Ray worker's
            # environment may lack; the same paths on every machine)
            settings = {**settings, **{name: info[name] for name in TLS_SETTINGS if name in info}}
        return api.init(info["address"], token=info["token"], **settings)


async def join_async(*, name: str = DEFAULT_NAME, namespace: str | None = None,
                     timeout: float | None = _JOIN_TIMEOUT_S, **settings: Any) -> api.Runtime:
    """`join` for async actors: never blocks their event loop."""
    _check_name(name, namespace)
    timeout = _JOIN_TIMEOUT_S if timeout is None else check_timeout(timeout)
    deadline = time.monotonic() + timeout
    first = await asyncio.to_thread(_find, name, namespace, timeout)
    info, error = await _group_info_async(name, namespace, deadline, first)
    if info is None:
        raise _unavailable(name, error) from error
    return await asyncio.to_thread(_adopt, info, settings)


def stop_directory(*, name: str = DEFAULT_NAME, namespace: str | None = None) -> None:
    """Stop and remove the directory actor and its standbys (nodes then
    reconnect until their deadline)."""
    _check_name(name, namespace)
    for member in [name, *(_standby_name(name, i) for i in range(1, MAX_STANDBYS + 1))]:
        _stop_one(member, namespace)


def _stop_one(name: str, namespace: str | None) -> None:
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(actor.stop.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # (dead already, or not answering: removed below all the same)
    finally:
        ray.kill(actor)
        _handles.pop(_key(name, namespace), None)

"""Authenticated, encrypted sockets between the front end and cores on other machines.

Cores in child processes talk over `ipc://` sockets in a private directory: only this
user can reach them. A core that Ray places on another node reaches the front end over
TCP, where anyone on the network could connect, read outputs or push forged frames.
There ZMQ's CURVE mechanism secures both sockets: the front end holds a server key
pair, each core a client key pair, all made at start-up and handed to the core through
Ray (never written to disk); a ZAP handler lets in only the client key of the core a
socket belongs to, so a peer without it cannot complete the handshake and no frame of
its reaches the codec.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

# The core process reads its keys from this environment variable (and removes it), so
# they never appear on a command line.
KEYS_ENV = "ASYNCLLM_CORE_CURVE_KEYS"


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """What one core needs: the front end's public key and its own key pair (Z85)."""

    server_public: bytes
    public: bytes
    secret: bytes

    def to_text(self) -> str:
        # Z85 uses neither "," nor whitespace.
        return b",".join((self.server_public, self.public, self.secret)).decode("ascii")

    @classmethod
    def from_text(cls, text: str) -> ClientKeys:
        parts = text.encode("ascii").split(b",")
        if len(parts) != 3 or any(len(p) != 40 for p in parts):
            raise ValueError("CURVE keys must be three 40-character Z85 keys")
        return cls(*parts)


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    """The front end's key pair for one core's sockets, and the one client key it admits."""

    public: bytes
    secret: bytes
    client: ClientKeys

    @classmethod
    def generate(cls) -> ServerKeys:
        public, secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(public, secret, ClientKeys(public, client_public, client_secret))


class _OneClient:
    """ZAP credentials provider: the core's public key and no other."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._public


def start_authenticator(ctx: zmq.Context[Any], keys: ServerKeys) -> ThreadAuthenticator:
    """A ZAP handler on `ctx` admitting only `keys.client`; stop it before ctx.term()."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OneClient(keys.client.public))
    return auth


def serve(sock: zmq.Socket[Any], keys: ServerKeys) -> None:
    """Make `sock` (which the front end binds) a CURVE server; before bind."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make `sock` (which the core connects) a CURVE client of the front end; before
    connect."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def take_client_keys(env: str = KEYS_ENV) -> ClientKeys | None:
    """The core's keys (or a tensor-parallel worker's, from `env`) from its
    environment, removed from it so that nothing the process starts inherits them;
    None where the peer is on this machine (ipc)."""
    text = os.environ.pop(env, None)
    return ClientKeys.from_text(text) if text else None

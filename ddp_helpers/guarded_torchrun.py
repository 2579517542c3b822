"""`python -m ddp_helpers.guarded_torchrun ARGUMENTS`: the real `torchrun ARGUMENTS`, with two guards that
plain torchrun lacks (`store_guard`): every store its agent hosts listens on loopback only, and its c10d
rendezvous state is signed with the key in $DDP_LESSONS_RENDEZVOUS_KEY (hex; the agents of one job share it;
it is removed from the environment before any worker starts). Without `--local-addr`, the agent names itself
127.0.0.1, so that its workers find the store it hosts on loopback.

Lessons 4 and 5 run torchrun's own behaviour through it (`lessons/plain_torchrun.py`): on a shared machine, a
demo must not open a door that another user could walk through.

`python -m ddp_helpers.guarded_torchrun --signed-only ARGUMENTS` keeps the signature and drops the loopback
guard: a job across nodes (the Slurm engine's) needs its stores on the nodes' network, where every user of the
cluster can reach them, and whoever writes the rendezvous state would otherwise run code as the learner.

Either way, an agent never joins a store on this machine that another user hosts (the port is public while the
agents start: whoever binds it first would host the job's store): the agent meant to host fails loudly instead.
"""

from __future__ import annotations

import os
import sys

KEY_ENV = "DDP_LESSONS_RENDEZVOUS_KEY"
SIGNED_ONLY = "--signed-only"


def new_key_line(python: str) -> str:
    """A job script's line that draws a new key for the agents it then starts (`python`: the job's own, quoted)."""
    return f"export {KEY_ENV}=$({python} -c 'import secrets; print(secrets.token_hex(32))')"


def main(arguments: list[str]) -> None:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        sys.exit(f"{KEY_ENV} is not set: it holds the key (hex) that signs this job's rendezvous state.")
    from .store_guard import keep_stores_on_loopback, refuse_other_users_stores, sign_rendezvous_state

    signed_only = arguments[:1] == [SIGNED_ONLY]
    if signed_only:
        arguments = arguments[1:]
    else:
        keep_stores_on_loopback()
        if not any(argument == "--local-addr" or argument.startswith("--local-addr=") for argument in arguments):
            arguments = ["--local-addr", "127.0.0.1", *arguments]
    sign_rendezvous_state(bytes.fromhex(key))
    refuse_other_users_stores()
    from torch.distributed.run import main as torchrun

    sys.argv = ["torchrun", *arguments]
    torchrun(arguments)


if __name__ == "__main__":
    main(sys.argv[1:])

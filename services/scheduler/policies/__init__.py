"""Built-in placement policies; importing this package registers all of them.

``vertumnus`` (§5.3) and the baselines of §9.1 and peer-routing.md: ``homo``, ``homo_cp2``,
``static``, ``vllm``, ``sglang``, ``dynamo``, ``llmd``, ``round_robin``.
"""

from services.scheduler.policies import (  # noqa: F401  (imported for registration)
    dynamo,
    llmd,
    round_robin,
    sglang,
    static,
    vertumnus,
    vllm,
)

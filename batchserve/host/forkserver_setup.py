"""The forkserver's own settings, made by importing this module there: it is the last name of children.PRELOAD,
and nothing else imports it.

What the preload imported is frozen out of the garbage collector (gc.freeze): a child's first full collection would
otherwise write to every object's header, and copy every page of the imported modules from the forkserver into the
child (copy-on-write), a cost paid by each child.

SIGTERM is ignored: a SIGTERM sent to the whole process group (a service manager stopping a server) would end the
forkserver at once, and the launcher reads its children's exit codes through the forkserver, so its live engine core
would read as dead mid-drain (exit code 255). The forkserver still ends with its launcher (multiprocessing closes a
pipe it watches). A child puts SIGTERM back to the default first thing (children.adopt_launcher). Its name in `ps`
is bs-forkserver, which the soak's per-process memory timeline reports as its role."""

from __future__ import annotations

import gc
import signal

from batchserve.host.process import name_process

name_process("bs-forkserver")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
gc.freeze()

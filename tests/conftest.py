"""What every test shares: Ctrl-C delivered to the processes the tests start.

A shell script that starts a command in the background without job control (``cmd &``,
``nohup ... &``) starts it with SIGINT ignored, as POSIX asks, and every process it
starts inherits that; Python then never raises KeyboardInterrupt. The servers, routers
and subscribers the tests stop with Ctrl-C would go on running. A handler (unlike
"ignored") is reset to the default in a new program, so installing Python's own here
gives every process the tests start the Ctrl-C a terminal would.
"""

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

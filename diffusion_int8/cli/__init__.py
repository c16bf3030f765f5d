"""The ``diffusion-int8`` command line: one module per subcommand, each an argparse layer over the library.

``calibrate`` and ``eval`` call ``diffusion_int8.calibrate`` and ``diffusion_int8.evaluate``; ``demo`` runs
those two commands' functions on the shipped model; ``check`` and ``tune`` call the kernels and
``speed_gate.measure``. ``common`` holds the model and prompt arguments that ``calibrate`` and ``eval``
share, ``usage`` the user errors, checked argument types and input and memory checks, ``outputs`` the output
sets written whole or not at all and the ending of a command on Ctrl-C or SIGTERM (``outputs.command``).
``diffusion_int8.__main__`` wires the subcommands; nothing outside this package imports it.
"""

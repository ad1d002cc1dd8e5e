"""``prefixcache demo``: placeholder replaced once the core lands."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="walk through the design's worked example")
    parser.set_defaults(func=lambda args: 0)

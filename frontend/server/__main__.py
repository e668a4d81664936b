"""`python -m tokenmill.frontend.server [MODEL] ...`: the same as `tokenmill serve`."""

from tokenmill.frontend.server.app import main

main()

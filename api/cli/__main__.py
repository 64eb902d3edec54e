import sys

from api.cli.main import main

sys.exit(main())

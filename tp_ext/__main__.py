import sys

from tp_ext.cli import main

sys.exit(main())

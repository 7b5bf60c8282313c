import sys

from services.buffer.main import main

sys.exit(main())

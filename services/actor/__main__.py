import sys

from services.actor.main import main

sys.exit(main())

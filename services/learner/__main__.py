import sys

from services.learner.main import main

sys.exit(main())

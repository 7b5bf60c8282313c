from services.common.runtime import exit_process
from services.learner.main import main

exit_process(main())

from services.common.runtime import exit_process
from services.planner.main import main

exit_process(main())

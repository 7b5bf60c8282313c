from services.common.runtime import exit_process
from services.actor.main import main

exit_process(main())

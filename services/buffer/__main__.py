from services.common.runtime import exit_process
from services.buffer.main import main

exit_process(main())

from services.common.service.runtime import exit_process, stop_cleanly_until_serving

stop_cleanly_until_serving()   # before the imports below (torch: seconds)

from services.buffer.main import main  # noqa: E402

exit_process(main())

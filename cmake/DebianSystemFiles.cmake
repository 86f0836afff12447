# CPACK_PRE_BUILD_SCRIPTS for the DEB generator: puts the server package's
# system files, whose places are absolute (/lib/systemd/system,
# /etc/default), into its staging tree, so that `cmake --install --prefix P`
# never writes outside P.
set(staging "${CPACK_TEMPORARY_DIRECTORY}/server")
if(NOT IS_DIRECTORY "${staging}")
  message(FATAL_ERROR "no staging tree for the server component at ${staging}")
endif()
# file(COPY_FILE), not file(INSTALL), which would prepend CPack's DESTDIR.
file(MAKE_DIRECTORY "${staging}/lib/systemd/system" "${staging}/etc/default")
file(COPY_FILE "@ATTENTION_DEBIAN_DIR@/attention-server.service"
  "${staging}/lib/systemd/system/attention-server.service")
file(COPY_FILE "@ATTENTION_DEBIAN_DIR@/default" "${staging}/etc/default/attention-server")

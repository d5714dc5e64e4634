# Every pulseloco header is included as <pulseloco/<component>/...> (and the umbrella headers as
# <pulseloco/pulseloco.h>, <pulseloco/torch.h>), in the build tree exactly as in an installed
# tree. The sources stay in their folders; pulseloco_include_tree() makes
# <dir>/pulseloco/<component> a link to each component's folder, so that <dir> is the only
# include root and no generic path ("base/errors.h") reaches a user's include path.

# component name under <pulseloco/...> = folder, relative to the repository root
set(PULSELOCO_HEADER_FOLDERS
  base=src/base
  kernels=kernels
  codec=src/codec
  io=src/io
  patch=src/patch
  transport=transport
  group=src/group
  collectives=collectives
  engine=src/engine
  elastic=src/elastic
  adapters=src/adapters
  cli=src/cli)

# Creates <dir>/pulseloco/ with one link per component folder and one per umbrella header of
# src/pulseloco/. `source_root` is the repository root.
function(pulseloco_include_tree source_root dir)
  file(MAKE_DIRECTORY ${dir}/pulseloco)
  foreach(entry ${PULSELOCO_HEADER_FOLDERS})
    string(REPLACE "=" ";" pair ${entry})
    list(GET pair 0 name)
    list(GET pair 1 folder)
    if(EXISTS ${source_root}/${folder})
      file(CREATE_LINK ${source_root}/${folder} ${dir}/pulseloco/${name} SYMBOLIC)
    endif()
  endforeach()
  file(GLOB umbrella_headers ${source_root}/src/pulseloco/*.h)
  foreach(header ${umbrella_headers})
    get_filename_component(name ${header} NAME)
    file(CREATE_LINK ${header} ${dir}/pulseloco/${name} SYMBOLIC)
  endforeach()
endfunction()
